"""Verify beside the conversion it checks, and the whole tool at Llama-3.1-70B shapes: wall time and peak host memory of
each step, in fresh processes, side by side with ``dd`` of the output's size.

    python benchmarks/bench_verify.py --shape 8b [--layers 32] [--steps ...] [--workdir DIR] [--json FILE]
    python benchmarks/bench_verify.py --shape 70b --layers 8 [--steps ...] [--workdir DIR] [--json FILE]

Checkpoints (built once into ``--workdir``, reused by a later run with the same shape and layers while the folder
is there; ``--build-only`` builds and stops):

  8b    Llama-3.1-8B shapes (hidden 4096, intermediate 14336, 8 KV heads, vocab 128256), bench_convert.py's builder:
        random packed bytes and absmax codes, NF4 with double quantization, blocksize 64, 5 GB shards.
  70b   Llama-3.1-70B shapes (hidden 8192, intermediate 28672, 64 heads, 8 KV heads, vocab 128256): random bf16
        weights quantized by bitsandbytes (``quantize_4bit`` on the GPU where there is one, NF4, double
        quantization, blocksize 64), saved as transformers saves them, 5 GB shards; lm_head untied, bf16.

Steps (``--steps``, comma-separated, run in the order given, each in a fresh process after a ``sync``):

  dd              dd if=/dev/zero of the dense output's size
  cuda, cpu       nf4convert SOURCE -o OUT --device cuda / cpu
  adapter         nf4convert SOURCE --adapter LORA --device cuda: a rank-64 LoRA on every linear layer merged
                  (adapter-cpu: the same on the CPU)
  cuda+verify     nf4convert SOURCE -o OUT --device cuda --verify (cpu+verify, adapter+verify likewise)
  verify-cuda     nf4convert verify OUT SOURCE --device cuda, OUT the cuda step's output (verify-cpu: the cpu step's
                  output on the CPU; verify-adapter: the adapter step's, --adapter LORA, on the GPU;
                  verify-cuda-on-cpu: the cuda step's output checked on the CPU)
  imports         python -c "import torch, bitsandbytes, transformers": what verify imports before it can start
  help            nf4convert --help (verify-help: nf4convert verify --help), the fastest of three runs

Each is timed at its process's exit and after a ``sync`` that follows; peak RssAnon (sampled every 5 ms) and peak
Pss (anonymous and shared memory) of the process with its children (every 50 ms), as bench_convert.py measures them.
Targets: a verify at most 1.5x the conversion that wrote its output (imports included), a conversion with --verify at
most 2.2x the same conversion alone, each --help under 0.2 s. Each run's NF4CONVERT_PROFILE reports (the conversion's,
then verify's: the moments they reached, the preload thread's imports) are kept in the JSON, their marks printed;
``--importtime`` runs each verify step once more under ``python -X importtime`` and keeps its slowest imports.
An output is removed once no later step reads it (the 70B outputs do not fit the disk together); the cuda and cpu
outputs, when both are made, are compared byte for byte. A markdown table on stdout; JSON with ``--json``.
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

from bench_convert import _weights, build_source, import_times, measure, sync_seconds, write_checkpoint

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8),
}
VOCAB = 128256
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHARD_BYTES = 5 * 10**9
CONVERSIONS = {"cuda": "cuda", "cpu": "cpu", "adapter": "cuda", "adapter-cpu": "cpu"}  # step -> its --device
IMPORTS = "import torch, bitsandbytes, transformers"
TARGETS = {"verify": 1.5, "+verify": 2.2}  # x its conversion: a verify step, a conversion with --verify
HELP_TARGET = 0.2  # seconds
# the conversion a step is compared with ("x its conversion"): a verify with the conversion that wrote its output
CONVERSION_OF = {
    "verify-cuda": "cuda",
    "verify-cpu": "cpu",
    "verify-adapter": "adapter",
    "verify-cuda-on-cpu": "cpu",
    "cuda+verify": "cuda",
    "cpu+verify": "cpu",
    "adapter+verify": "adapter",
    "verify-adapter-cpu": "adapter-cpu",
    "adapter-cpu+verify": "adapter-cpu",
}


def weights(shape: str, layers: int, vocab: int = VOCAB):
    """(name, (rows, columns) or (n,), quantized) in the order transformers saves a Llama."""
    yield from _weights(layers, vocab, SHAPES[shape])


def build_quantized(folder: Path, shape: str, layers: int, vocab: int = VOCAB) -> int:
    """Random bf16 weights quantized by bitsandbytes (NF4, double quantization, blocksize 64), saved in 5 GB shards as
    transformers saves them; returns the dense bf16 output's bytes."""
    import bitsandbytes.functional as F
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)

    def quantized_weights():
        for name, dims, quantized in weights(shape, layers, vocab):
            values = torch.randn(dims, device=device, generator=generator, dtype=torch.float32).mul_(0.02)
            values = values.to(torch.bfloat16)
            if not quantized:
                yield {name: values.cpu()}
                continue
            packed, state = F.quantize_4bit(values, blocksize=64, compress_statistics=True, quant_type="nf4")
            del values
            parts = state.as_dict(packed=True)
            yield {name: packed.cpu(), **{f"{name}.{key}": value.cpu() for key, value in parts.items()}}

    sizes = {**SHAPES[shape], "vocab_size": vocab, "num_hidden_layers": layers}
    write_checkpoint(folder, quantized_weights(), sizes, SHARD_BYTES)
    return sum(2 * math.prod(dims) for _, dims, _ in weights(shape, layers, vocab))


def build_adapter(folder: Path, shape: str, layers: int, rank: int) -> None:
    """A peft LoRA adapter (alpha 2 x rank) on every linear layer of the blocks, random non-zero bf16 factors."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, task_type="CAUSAL_LM").save_pretrained(folder)
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for name, dims, quantized in weights(shape, layers):
        if quantized:
            module = "base_model.model." + name.removesuffix(".weight")
            a = torch.randn(rank, dims[1], generator=generator) * 0.01
            b = torch.randn(dims[0], rank, generator=generator) * 0.01
            tensors[f"{module}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{module}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})


def source_for(workdir: Path, shape: str, layers: int, vocab: int) -> tuple[Path, int]:
    """The checkpoint of ``shape``, ``layers`` and ``vocab`` in ``workdir``, built unless a finished build is there."""
    source = workdir / f"llama-{shape}-shaped-{layers}-layers-{vocab}-vocab-bnb-4bit"
    marker = source / ".built"
    if marker.is_file():
        dense = json.loads(marker.read_text())["dense_bytes"]
        print(f"source: {source} (built before), dense output {dense / 1e9:.2f} GB", flush=True)
        return source, dense
    shutil.rmtree(source, ignore_errors=True)
    for other in workdir.glob("llama-*-bnb-4bit"):  # one checkpoint at a time: the disk holds its outputs
        shutil.rmtree(other, ignore_errors=True)
    started = time.perf_counter()
    if shape == "8b":
        dense = build_source(source, layers, vocab_size=vocab)
    else:
        dense = build_quantized(source, shape, layers, vocab)
    marker.write_text(json.dumps({"dense_bytes": dense}))
    gigabytes = sum(p.stat().st_size for p in source.glob("*.safetensors")) / 1e9
    print(
        f"source: {gigabytes:.2f} GB in {time.perf_counter() - started:.1f} s; dense output {dense / 1e9:.2f} GB",
        flush=True,
    )
    return source, dense


def plan_steps(steps: list[str]) -> list[dict]:
    """Each step's command parts: the output it writes or reads, and whether it converts, verifies or both."""
    planned = []
    for step in steps:
        route, _, then = step.partition("+")
        if step in ("dd", "imports", "help", "verify-help"):
            planned.append({"step": step})
        elif step.startswith("verify-"):
            made, _, on = step.removeprefix("verify-").partition("-on-")
            if made not in CONVERSIONS:
                raise SystemExit(f"unknown step {step!r}: no conversion {made!r}")
            planned.append({"step": step, "reads": f"out-{made}", "device": on or CONVERSIONS[made]})
        elif route in CONVERSIONS and then in ("", "verify"):
            planned.append({"step": step, "writes": f"out-{step}", "device": CONVERSIONS[route]})
        else:
            raise SystemExit(f"unknown step {step!r}")
    return planned


def command(step: dict, source: Path, adapter: Path, workdir: Path, dense: int) -> list[str]:
    module = [sys.executable, "-m", "nf4convert.cli.commands"]
    name = step["step"]
    if name == "dd":
        out = workdir / "out-dd"
        return ["bash", "-c", f"mkdir -p {out} && dd if=/dev/zero of={out}/model.bin bs=64M iflag=count_bytes "
                f"count={dense} status=none"]  # fmt: skip
    if name == "imports":
        return [sys.executable, "-c", IMPORTS]
    if name in ("help", "verify-help"):
        return [*module, *(["verify"] if name == "verify-help" else []), "--help"]
    if "reads" in step:
        merged = ["--adapter", str(adapter)] if step["reads"].startswith("out-adapter") else []
        return [*module, "verify", str(workdir / step["reads"]), str(source), "-q", "--device", step["device"], *merged]
    merged = ["--adapter", str(adapter)] if name.startswith("adapter") else []
    then = ["--verify"] if name.endswith("+verify") else []
    return [*module, str(source), "-o", str(workdir / step["writes"]), "-q", "--overwrite", "--device",
            step["device"], *merged, *then]  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--layers", type=int, default=None, help="default: 32 for 8b, 8 for 70b")
    parser.add_argument(
        "--steps", default="dd,cuda,verify-cuda,cuda+verify,cpu,verify-cpu,cpu+verify,imports,help,verify-help"
    )
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench-verify")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="a smaller vocabulary makes a smaller checkpoint")
    parser.add_argument("--rank", type=int, default=64, help="the adapter's LoRA rank")
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--importtime", action="store_true", help="each verify step once more under -X importtime")
    parser.add_argument("--json")
    options = parser.parse_args()
    layers = options.layers or (32 if options.shape == "8b" else 8)
    workdir = options.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    source, dense = source_for(workdir, options.shape, layers, options.vocab)
    steps = plan_steps([s for s in options.steps.split(",") if s])
    adapter = workdir / f"lora-{options.shape}-{layers}-r{options.rank}"
    if any("adapter" in step["step"] for step in steps) and not (adapter / "adapter_config.json").is_file():
        build_adapter(adapter, options.shape, layers, options.rank)
    if options.build_only:
        return
    last_read = {}
    for index, step in enumerate(steps):
        for key in ("writes", "reads"):
            if key in step:
                last_read[step[key]] = index
    if "out-cuda" in last_read and "out-cpu" in last_read:  # each kept until the other is made: compared
        made = max(i for i, s in enumerate(steps) if s.get("writes") in ("out-cuda", "out-cpu"))
        for out in ("out-cuda", "out-cpu"):
            last_read[out] = max(last_read[out], made)
    results = {}
    for index, step in enumerate(steps):
        name = step["step"]
        if "writes" in step:
            shutil.rmtree(workdir / step["writes"], ignore_errors=True)
        subprocess.run(["sync"], check=True)
        try:
            run = measure(command(step, source, adapter, workdir, dense), {"NF4CONVERT_PROFILE": "1"})
            if name.endswith("help"):  # the fastest of three: a process start, not the machine's noise
                run = min([run, *(measure(command(step, source, adapter, workdir, dense)) for _ in range(2))],
                          key=lambda r: r["seconds"])  # fmt: skip
        except SystemExit as error:
            print(f"{name}: failed: {str(error)[-800:]}", flush=True)
            continue
        run["synced_seconds"] = run["seconds"] + sync_seconds()
        if options.importtime and "verify" in name and not name.endswith("help"):
            run["imports"] = import_times(command(step, source, adapter, workdir, dense))
        results[name] = run
        print(name, json.dumps(run), flush=True)
        cuda, cpu = workdir / "out-cuda", workdir / "out-cpu"
        if "writes" in step and step["writes"] in ("out-cuda", "out-cpu") and cuda.is_dir() and cpu.is_dir():
            same = all(
                subprocess.run(["cmp", "-s", str(path), str(cpu / path.name)]).returncode == 0
                for path in sorted(cuda.glob("*.safetensors"))
            )
            results[name]["identical_cuda_cpu"] = same
            print(f"cuda and cpu outputs identical: {same}", flush=True)
        for out in ["out-dd", *(out for out, last in last_read.items() if last == index)]:
            shutil.rmtree(workdir / out, ignore_errors=True)
    report(results, options, layers, dense)


def report(results: dict, options, layers: int, dense: int) -> None:
    import bitsandbytes
    import torch
    import transformers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(
        f"\n{gpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"bitsandbytes {bitsandbytes.__version__}, Python {platform.python_version()}, "
        f"{datetime.date.today().isoformat()}; {options.shape} shapes, {layers} layers, "
        f"{dense / 1e9:.2f} GB of bf16 out"
    )
    print(
        "| step | s (exit) | x dd | s (+sync) | x dd | x its conversion | target | peak RssAnon | "
        "peak Pss with children |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    dd = results.get("dd")

    def ratio(value, base):
        return f"{value / base:.2f}" if base else "-"

    for name, r in results.items():
        converted = CONVERSION_OF.get(name)
        against = results.get(converted, {}).get("seconds") if converted else None
        target = TARGETS["+verify" if name.endswith("+verify") else "verify"] if converted else None
        if name.endswith("help"):
            verdict = f"< {HELP_TARGET} s {'met' if r['seconds'] < HELP_TARGET else 'MISSED'}"
        elif target is not None and against:
            verdict = f"{target} {'met' if r['seconds'] / against <= target else 'MISSED'}"
        else:
            verdict = "-"
        print(
            f"| {name} | {r['seconds']:.2f} | {ratio(r['seconds'], dd and dd['seconds'])} | "
            f"{r['synced_seconds']:.1f} | {ratio(r['synced_seconds'], dd and dd['synced_seconds'])} | "
            f"{ratio(r['seconds'], against)} | {verdict} | {r['peak_anon_mb']:.0f} MB | "
            f"{r['peak_tree_pss_mb']:.0f} MB |"
        )
    identical = [r["identical_cuda_cpu"] for r in results.values() if "identical_cuda_cpu" in r]
    if identical:
        print(f"cuda and cpu outputs byte-identical: {identical[-1]}")
    print("\nwhere the time went (seconds since the process started, NF4CONVERT_PROFILE; conversion, then verify):")
    for name, r in results.items():
        for report_of in r.get("profiles") or ([r["profile"]] if "profile" in r else []):
            marks = report_of.get("marks", {})
            print(f"  {name}: " + ", ".join(f"{mark} {at}" for mark, at in marks.items()))
        for module, seconds in r.get("imports", [])[:8]:
            print(f"      import {seconds:6.2f} s  {module}")
    if options.json:
        Path(options.json).write_text(
            json.dumps(
                {"gpu": gpu, "shape": options.shape, "layers": layers, "dense_bytes": dense, "results": results},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
