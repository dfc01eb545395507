"""GPTQ and AWQ conversion beside the disk's own speed: 8B-shaped checkpoints and layers of a 70B-shaped one, every
route, with a LoRA merged, and verify.

    python benchmarks/bench_int.py [--workdir DIR] [--checkpoints gptq-8b,awq-8b,gptq-70b] [--layers N]
        [--vocab N] [--steps dd,cuda,cpu,adapter,verify-cuda,verify-cpu,...] [--json FILE]

Synthesizes, one at a time (each removed before the next is made: a 64 GB disk holds one with its output):

  gptq-8b   Llama-3.1-8B shapes (hidden 4096, intermediate 14336, 8 KV heads, 32 layers, vocab 128256), GPTQ 4-bit,
            groups of 128, desc_act (each layer's g_idx a random permutation of whole groups), asymmetric, v1 zeros
            (checkpoint_format "gptq"), fp16 scales, int32 words; embeddings and lm_head fp16.
  awq-8b    the same shapes, AWQ 4-bit GEMM, groups of 128, zero points, fp16 scales.
  gptq-70b  Llama-3.1-70B layers (hidden 8192, intermediate 28672, 8 KV heads), GPTQ as gptq-8b, --layers of them
            (4 by default) and a small vocabulary (the layers are what is measured: down_proj's codes are 117 MB read
            whole once).

Codes, zeros and scales are random and valid (every packed word is a valid word; scales small and positive), so every
route reads them as a real checkpoint's: seconds to make, not minutes to quantize. Steps, each in a fresh process
with the output removed and ``sync`` before it:

  dd            dd if=/dev/zero of=OUT: as many bytes as the dense fp16 output
  cuda, cpu     nf4convert SOURCE -o OUT --device cuda / cpu
  adapter       nf4convert SOURCE --adapter ADAPTER --device cuda: a rank-64 LoRA on every linear layer merged
  adapter-cpu   the same on the CPU route
  verify-cuda   nf4convert verify OUT SOURCE --device cuda, of the cuda step's output (kept for it)
  verify-cpu    the same with --device cpu

Each step's time when its process exits and after a ``sync`` that follows; peak host memory (RssAnon of the process,
and the proportional anonymous and shared pages of it and its children: bench_convert.measure). The cpu output is
compared byte for byte with the cuda output where both ran. The table says each step's time over dd's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_convert import measure, sync_seconds

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8),
}
CHECKPOINTS = {  # name -> (format, shape, default layers, default vocabulary)
    "gptq-8b": ("gptq", "8b", 32, 128256),
    "awq-8b": ("awq", "8b", 32, 128256),
    "gptq-70b": ("gptq", "70b", 4, 1024),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GROUP, PACK = 128, 8  # 4-bit codes in int32 words


def linear_shapes(sizes: dict, layers: int):
    """(name, (out, in)) of every linear layer, in the order transformers saves a Llama."""
    hidden, inter = sizes["hidden_size"], sizes["intermediate_size"]
    kv = sizes["num_key_value_heads"] * (hidden // sizes["num_attention_heads"])
    for i in range(layers):
        for name, shape in (
            ("self_attn.q_proj", (hidden, hidden)),
            ("self_attn.k_proj", (kv, hidden)),
            ("self_attn.v_proj", (kv, hidden)),
            ("self_attn.o_proj", (hidden, hidden)),
            ("mlp.gate_proj", (inter, hidden)),
            ("mlp.up_proj", (inter, hidden)),
            ("mlp.down_proj", (hidden, inter)),
        ):
            yield f"model.layers.{i}.{name}", shape


def build_source(folder: Path, method: str, sizes: dict, layers: int, vocab: int, shard_bytes=5 * 10**9) -> int:
    """Write the checkpoint; returns the bytes of its dense fp16 output."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    device = "cuda" if torch.cuda.is_available() else "cpu"  # random bytes at GPU speed where there is one
    generator = torch.Generator(device).manual_seed(0)
    hidden = sizes["hidden_size"]

    def words(*shape):
        raw = torch.randint(0, 256, (math.prod(shape) * 4,), dtype=torch.uint8, device=device, generator=generator)
        return raw.view(torch.int32).view(shape).cpu()

    def scales(*shape):
        return (torch.rand(shape, device=device, generator=generator) * 0.02 + 1e-3).half().cpu()

    def dense(*shape):
        return (torch.randn(shape, device=device, generator=generator) * 0.02).half().cpu()

    def tensors():
        yield {"model.embed_tokens.weight": dense(vocab, hidden)}
        for index, (prefix, (out, columns)) in enumerate(linear_shapes(sizes, layers)):
            groups = columns // GROUP
            if method == "gptq":
                columns_order = torch.randperm(columns, generator=torch.Generator().manual_seed(index))
                g_idx = torch.arange(groups).repeat_interleave(GROUP)[columns_order]
                yield {
                    f"{prefix}.qweight": words(columns // PACK, out),
                    f"{prefix}.qzeros": words(groups, out // PACK),
                    f"{prefix}.scales": scales(groups, out),
                    f"{prefix}.g_idx": g_idx.to(torch.int32),
                }
            else:
                yield {
                    f"{prefix}.qweight": words(columns, out // PACK),
                    f"{prefix}.qzeros": words(groups, out // PACK),
                    f"{prefix}.scales": scales(groups, out),
                }
            if prefix.endswith("down_proj"):
                layer = prefix.rsplit(".", 2)[0]
                yield {f"{layer}.input_layernorm.weight": dense(hidden), f"{layer}.post_attention_layernorm.weight":
                       dense(hidden)}  # fmt: skip
        yield {"model.norm.weight": dense(hidden), "lm_head.weight": dense(vocab, hidden)}

    folder.mkdir(parents=True, exist_ok=True)
    weight_map, current, size, parts = {}, {}, 0, []

    def flush():
        nonlocal current, size
        if current:
            parts.append(list(current))
            save_file(current, folder / f"part-{len(parts)}.safetensors", metadata={"format": "pt"})
            current, size = {}, 0

    for group in tensors():
        nbytes = sum(t.numel() * t.element_size() for t in group.values())
        if size + nbytes > shard_bytes:
            flush()
        current.update(group)
        size += nbytes
    flush()
    for index, names in enumerate(parts, 1):
        target = f"model-{index:05d}-of-{len(parts):05d}.safetensors"
        (folder / f"part-{index}.safetensors").rename(folder / target)
        weight_map.update(dict.fromkeys(names, target))
    total = sum((folder / name).stat().st_size for name in set(weight_map.values()))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    config = LlamaConfig(
        **sizes, num_hidden_layers=layers, vocab_size=vocab, tie_word_embeddings=False, torch_dtype="float16"
    ).to_dict()
    if method == "gptq":
        quantization = dict(quant_method="gptq", bits=4, group_size=GROUP, desc_act=True, sym=False,
                            checkpoint_format="gptq", pack_dtype="int32")  # fmt: skip
    else:
        quantization = dict(quant_method="awq", bits=4, group_size=GROUP, zero_point=True, version="gemm")
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
    linear = sum(out * columns for _, (out, columns) in linear_shapes(sizes, layers))
    return 2 * (linear + 2 * vocab * hidden + (2 * layers + 1) * hidden)


def build_adapter(folder: Path, sizes: dict, layers: int, rank: int = 64) -> None:
    """A peft LoRA adapter of rank ``rank`` (alpha twice that) on every linear layer, random factors in bf16."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, task_type="CAUSAL_LM").save_pretrained(folder)
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for prefix, (out, columns) in linear_shapes(sizes, layers):
        module = f"base_model.model.{prefix}"
        tensors[f"{module}.lora_A.weight"] = (torch.randn(rank, columns, generator=generator) * 0.01).bfloat16()
        tensors[f"{module}.lora_B.weight"] = (torch.randn(out, rank, generator=generator) * 0.01).bfloat16()
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})


def run_checkpoint(name: str, workdir: Path, steps: list[str], layers: int | None, vocab: int | None) -> dict:
    method, shape, default_layers, default_vocab = CHECKPOINTS[name]
    layers, vocab = layers or default_layers, vocab or default_vocab
    sizes = SHAPES[shape]
    source = workdir / f"llama-{shape}-shaped-{method}"
    shutil.rmtree(source, ignore_errors=True)
    started = time.perf_counter()
    dense = build_source(source, method, sizes, layers, vocab)
    source_bytes = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    print(f"{name}: source {source_bytes / 1e9:.2f} GB in {time.perf_counter() - started:.1f} s, "
          f"{layers} layers; dense output {dense / 1e9:.2f} GB", flush=True)  # fmt: skip
    adapter = workdir / "lora-r64"
    if any(step.startswith("adapter") for step in steps):
        shutil.rmtree(adapter, ignore_errors=True)
        build_adapter(adapter, sizes, layers)
    module = [sys.executable, "-m", "nf4convert.cli.commands"]
    outputs = {step: workdir / f"out-{name}-{step}" for step in steps}
    kept = {"cuda": outputs.get("cuda"), "cpu": outputs.get("cpu")}

    def convert(step, device, *extra):
        return [*module, str(source), "-q", "--overwrite", "-o", str(outputs[step]), "--device", device, *extra]

    commands = {
        "dd": lambda: [
            "bash",
            "-c",
            f"mkdir -p {outputs['dd']} && dd if=/dev/zero of={outputs['dd']}/model.bin "
            f"bs=64M iflag=count_bytes count={dense} status=none",
        ],  # fmt: skip
        "cuda": lambda: convert("cuda", "cuda"),
        "cpu": lambda: convert("cpu", "cpu"),
        "adapter": lambda: convert("adapter", "cuda", "--adapter", str(adapter)),
        "adapter-cpu": lambda: convert("adapter-cpu", "cpu", "--adapter", str(adapter)),
        "verify-cuda": lambda: [
            *module,
            "verify",
            str(kept["cuda"] or kept["cpu"]),
            str(source),
            "-q",
            "--device",
            "cuda",
        ],  # fmt: skip
        "verify-cpu": lambda: [
            *module,
            "verify",
            str(kept["cpu"] or kept["cuda"]),
            str(source),
            "-q",
            "--device",
            "cpu",
        ],  # fmt: skip
    }
    results = {}
    for step in steps:
        if step not in commands:
            raise SystemExit(f"unknown step {step!r}: {', '.join(commands)}")
        if not step.startswith("verify"):
            shutil.rmtree(outputs[step], ignore_errors=True)
        subprocess.run(["sync"], check=True)
        try:
            run = measure(commands[step](), {"NF4CONVERT_PROFILE": "1"})
        except SystemExit as error:
            print(f"{name} {step}: failed: {str(error)[-800:]}", flush=True)
            continue
        run["synced_seconds"] = run["seconds"] + sync_seconds()
        results[step] = run
        print(f"{name} {step}", json.dumps(run), flush=True)
        if step == "cpu" and "cuda" in results:
            same = all(
                subprocess.run(["cmp", "-s", str(path), str(outputs["cpu"] / path.name)]).returncode == 0
                for path in sorted(outputs["cuda"].glob("*.safetensors"))
            )
            results[step]["identical_to_cuda"] = same
            print(f"{name}: cuda and cpu outputs identical: {same}", flush=True)
        if step not in ("cuda", "cpu"):  # kept for verify and the comparison
            shutil.rmtree(outputs[step], ignore_errors=True)
    for path in (*outputs.values(), source, adapter):
        shutil.rmtree(path, ignore_errors=True)
    return {"layers": layers, "vocab": vocab, "dense_bytes": dense, "source_bytes": source_bytes, "results": results}


def table(name: str, measured: dict) -> None:
    dense, results = measured["dense_bytes"], measured["results"]
    dd = results.get("dd")
    conversion = results.get("cuda") or results.get("cpu")
    print(f"\n{name}: {measured['layers']} layers, {dense / 1e9:.2f} GB of fp16 out")
    print("| step | s (exit) | x dd | s (+sync) | x dd | GB/s (+sync) | peak RssAnon | peak Pss with children ", end="")
    print("| x conversion |")
    print("|---|---|---|---|---|---|---|---|---|")
    for step, r in results.items():
        ratio = f"{r['seconds'] / dd['seconds']:.2f}" if dd else "-"
        ratio_synced = f"{r['synced_seconds'] / dd['synced_seconds']:.2f}" if dd else "-"
        against = results.get("cpu" if step == "verify-cpu" else "cuda") or conversion
        versus = f"{r['seconds'] / against['seconds']:.2f}" if step.startswith("verify") and against else "-"
        print(
            f"| {step} | {r['seconds']:.1f} | {ratio} | {r['synced_seconds']:.1f} | {ratio_synced} | "
            f"{dense / 1e9 / r['synced_seconds']:.2f} | {r['peak_anon_mb']:.0f} MB | {r['peak_tree_pss_mb']:.0f} MB | "
            f"{versus} |"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--checkpoints", default="gptq-8b,awq-8b,gptq-70b", help=", ".join(CHECKPOINTS))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: each checkpoint's)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary (default: each checkpoint's)")
    parser.add_argument("--steps", default="dd,cuda,cpu,adapter,verify-cuda")
    parser.add_argument("--json")
    options = parser.parse_args()
    import torch

    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="nf4convert-bench-int-"))
    workdir.mkdir(parents=True, exist_ok=True)
    steps = options.steps.split(",")
    measured = {}
    for name in options.checkpoints.split(","):
        measured[name] = run_checkpoint(name, workdir, steps, options.layers, options.vocab)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"\n{gpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}, Python {platform.python_version()}, "
          f"{datetime.date.today().isoformat()}")  # fmt: skip
    for name, result in measured.items():
        table(name, result)
    if options.json:
        Path(options.json).write_text(json.dumps({"gpu": gpu, "checkpoints": measured}, indent=1))
    if options.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
