"""Whole-model conversion time beside the disk's own speed: an 8B-shaped NF4 checkpoint, every route in one run.

    python benchmarks/bench_convert.py [--workdir DIR] [--layers 32] [--no-transformers] [--json FILE]

Synthesizes a Llama-3.1-8B-shaped bitsandbytes 4-bit checkpoint (hidden 4096, intermediate 14336, 32 layers,
8 KV heads, vocab 128256, untied lm_head kept bf16 as transformers saves it; NF4, double quantization, blocksize
64, 5 GB shards): packed bytes and absmax codes random, nested absmax random and positive, the tables
bitsandbytes' own, the quant-state JSON as bitsandbytes writes it. Valid, so every route reads it as a real
one; nothing is quantized (that would take minutes for 8B weights).

Then, each in a fresh process, output removed and the page cache's dirty pages synced before each:

  nf4convert cuda   nf4convert SOURCE -o OUT --device cuda
  nf4convert cpu    nf4convert SOURCE -o OUT --device cpu
  dd                dd if=/dev/zero of=OUT bs=64M: the same number of bytes as the dense output
  transformers      from_pretrained(device_map="cuda") -> dequantize() -> save_pretrained
  adapter           nf4convert SOURCE --adapter ADAPTER --device cuda: a rank-16 LoRA on every linear layer merged
  peft              the same with transformers and peft: from_pretrained(device_map="cuda") -> dequantize() ->
                    PeftModel.from_pretrained(ADAPTER) -> merge_and_unload() -> save_pretrained

Each route's time is taken twice: when its process exits, and after a ``sync`` that follows (the bytes on
disk). Peak host memory is the process's RssAnon (heap, Python, torch, pinned buffers; not the page cache),
sampled every 5 ms, and that of the process with its children (the cpu route's worker processes): their
proportional anonymous and shared-memory pages (Pss_Anon + Pss_Shmem, so pages a forked child shares with its
parent count once), sampled every 50 ms. The cuda and cpu outputs are compared byte for byte.
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

LLAMA_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256
)
PEFT_ROUTE = """
import sys, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="cuda").dequantize()
model = PeftModel.from_pretrained(model, sys.argv[3]).merge_and_unload()
model.save_pretrained(sys.argv[2], save_original_format=False)
"""
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TRANSFORMERS_ROUTE = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="cuda")
model = model.dequantize()
model.save_pretrained(sys.argv[2], save_original_format=False)
"""


def write_checkpoint(folder: Path, weights, sizes: dict, shard_bytes: int = 5 * 10**9) -> None:
    """Save ``weights`` (one dict of tensors per weight, in the order transformers saves them) as transformers saves a
    bnb-4bit Llama of ``sizes`` (LlamaConfig's arguments): shards of at most ``shard_bytes`` under transformers'
    names, their index, and config.json (NF4, double quantization, bf16, lm_head untied). Each shard's tensors are
    dropped once it is written."""
    import torch
    from safetensors.torch import save_file
    from transformers import BitsAndBytesConfig, LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    names, current, size = [], {}, 0  # names: each written part's tensor names

    def flush():
        nonlocal current, size
        if current:
            names.append(list(current))
            save_file(current, folder / f"part-{len(names)}.safetensors", metadata={"format": "pt"})
            current, size = {}, 0

    for tensors in weights:
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if size + nbytes > shard_bytes:
            flush()
        current.update(tensors)
        size += nbytes
    flush()
    weight_map = {}
    for index, part in enumerate(names, 1):
        target = folder / f"model-{index:05d}-of-{len(names):05d}.safetensors"
        (folder / f"part-{index}.safetensors").rename(target)
        weight_map.update(dict.fromkeys(part, target.name))
    total = sum((folder / name).stat().st_size for name in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config = LlamaConfig(**sizes, tie_word_embeddings=False, torch_dtype="bfloat16").to_dict()
    config["quantization_config"] = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    ).to_dict()
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))


def _weights(layers: int, vocab_size: int = LLAMA_8B["vocab_size"], sizes: dict = LLAMA_8B):
    """(name, shape, quantized) in the order transformers saves a Llama of ``sizes`` (8B's by default)."""
    hidden, inter = sizes["hidden_size"], sizes["intermediate_size"]
    kv = sizes["num_key_value_heads"] * (hidden // sizes["num_attention_heads"])
    yield "model.embed_tokens.weight", (vocab_size, hidden), False
    for i in range(layers):
        prefix = f"model.layers.{i}"
        for name, shape in (
            ("self_attn.q_proj", (hidden, hidden)),
            ("self_attn.k_proj", (kv, hidden)),
            ("self_attn.v_proj", (kv, hidden)),
            ("self_attn.o_proj", (hidden, hidden)),
            ("mlp.gate_proj", (inter, hidden)),
            ("mlp.up_proj", (inter, hidden)),
            ("mlp.down_proj", (hidden, inter)),
        ):
            yield f"{prefix}.{name}.weight", shape, True
        yield f"{prefix}.input_layernorm.weight", (hidden,), False
        yield f"{prefix}.post_attention_layernorm.weight", (hidden,), False
    yield "model.norm.weight", (hidden,), False
    yield "lm_head.weight", (vocab_size, hidden), False


def build_source(
    folder: Path, layers: int, shard_bytes: int = 5 * 10**9, vocab_size: int = LLAMA_8B["vocab_size"]
) -> int:
    """Write the synthesized checkpoint; returns the bytes of its dense bf16 output."""
    import torch
    from bitsandbytes.functional import create_dynamic_map

    from nf4convert.formats.bnb4 import CODES

    device = "cuda" if torch.cuda.is_available() else "cpu"  # random bytes at GPU speed where there is one
    generator = torch.Generator(device).manual_seed(0)
    quant_map = torch.tensor(CODES["nf4"], dtype=torch.float32)
    nested_map = create_dynamic_map(signed=True).float()

    def weights():
        for name, shape, quantized in _weights(layers, vocab_size):
            n = math.prod(shape)
            if not quantized:
                yield {name: (torch.randn(shape, device=device, generator=generator) * 0.02).to(torch.bfloat16).cpu()}
                continue
            blocks = n // 64
            meta = {
                "quant_type": "nf4",
                "blocksize": 64,
                "dtype": "bfloat16",
                "shape": list(shape),
                "nested_blocksize": 256,
                "nested_dtype": "float32",
                "nested_offset": 0.0312,
            }
            yield {
                name: torch.randint(0, 256, (n // 2, 1), dtype=torch.uint8, device=device, generator=generator).cpu(),
                f"{name}.absmax": torch.randint(
                    0, 256, (blocks,), dtype=torch.uint8, device=device, generator=generator
                ).cpu(),
                f"{name}.quant_map": quant_map.clone(),
                f"{name}.nested_absmax": (
                    torch.rand(-(-blocks // 256), device=device, generator=generator) * 0.05 + 1e-3
                ).cpu(),
                f"{name}.nested_quant_map": nested_map.clone(),
                f"{name}.quant_state.bitsandbytes__nf4": torch.tensor(
                    list(json.dumps(meta).encode()), dtype=torch.uint8
                ),
            }

    sizes = {**LLAMA_8B, "vocab_size": vocab_size, "num_hidden_layers": layers}
    write_checkpoint(folder, weights(), sizes, shard_bytes)
    return sum(2 * math.prod(shape) for _, shape, _ in _weights(layers, vocab_size))


def build_adapter(folder: Path, layers: int, rank: int = 16) -> None:
    """A peft LoRA adapter (rank 16, alpha 32) on every linear layer, random non-zero factors stored in bf16."""
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, task_type="CAUSAL_LM").save_pretrained(folder)
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for name, shape, quantized in _weights(layers):
        if quantized:
            module = "base_model.model." + name.removesuffix(".weight")
            tensors[f"{module}.lora_A.weight"] = (torch.randn(rank, shape[1], generator=generator) * 0.01).to(
                torch.bfloat16
            )
            tensors[f"{module}.lora_B.weight"] = (torch.randn(shape[0], rank, generator=generator) * 0.01).to(
                torch.bfloat16
            )
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})


def measure(command: list[str], env: dict | None = None, cwd: str | None = None, output: bool = False) -> dict:
    """Run ``command``; its wall time and the peak of its RssAnon and VmRSS, sampled every 5 ms; nf4convert's
    pipeline profile (NF4CONVERT_PROFILE=1) when it printed one; with ``output``, what it printed (``stdout``)."""
    with tempfile.TemporaryFile() as stderr, tempfile.TemporaryFile() as stdout:  # files: a chatty route never blocks
        started = time.perf_counter()
        process = subprocess.Popen(
            command,
            stdout=stdout if output else subprocess.DEVNULL,
            stderr=stderr,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
        peak_anon = peak_rss = peak_tree = 0
        status = Path(f"/proc/{process.pid}/status")
        samples = 0
        while process.poll() is None:
            try:
                fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
                peak_anon = max(peak_anon, int(fields.get("RssAnon", "0 kB").split()[0]))
                peak_rss = max(peak_rss, int(fields.get("VmRSS", "0 kB").split()[0]))
            except (OSError, ValueError):
                pass
            if samples % 10 == 0:
                peak_tree = max(peak_tree, _tree_pss_kb(process.pid))
            samples += 1
            time.sleep(0.005)
        seconds = time.perf_counter() - started
        stderr.seek(0)
        text = stderr.read().decode(errors="replace")
        stdout.seek(0)
        printed = stdout.read().decode(errors="replace")
        if process.returncode != 0:
            raise SystemExit(f"{command[0]} failed:\n{text[-3000:]}")
    run = {
        **({"stdout": printed} if output else {}),
        "seconds": seconds,
        "peak_anon_mb": peak_anon / 1024,
        "peak_rss_mb": peak_rss / 1024,
        "peak_tree_pss_mb": peak_tree / 1024,
    }
    profiles = [
        json.loads(line) for line in text.splitlines() if line.startswith(('{"profile"', '{"pipeline_seconds"'))
    ]
    if len(profiles) > 1:  # a conversion, then the verify that followed it: each its own report
        run["profiles"] = [line.get("profile", line) for line in profiles]
    if profiles:  # this code's report, or the older one-line pipeline figures (a route run @ older code)
        old = profiles[-1].get("profile") is None
        run["profile"] = (
            profiles[-1]["profile"]
            if not old
            else {
                "marks": {"reported": profiles[-1]["process_seconds"]},
                "pipeline": {
                    "seconds": profiles[-1]["pipeline_seconds"],
                    **{k: profiles[-1][k] for k in ("pieces", "busy", "waited")},
                },
            }
        )
    return run


def import_times(command: list[str], top: int = 15) -> list[tuple[str, float]]:
    """``command`` (a Python one: ``[python, ...]``) run once more under ``python -X importtime``: its ``top`` slowest
    imports, (module, cumulative seconds), each with what it imported beneath it (so a package and its submodules
    both show: read the chain)."""
    with tempfile.TemporaryFile() as stderr:
        subprocess.run([command[0], "-X", "importtime", *command[1:]], stdout=subprocess.DEVNULL, stderr=stderr)
        stderr.seek(0)
        lines = stderr.read().decode(errors="replace").splitlines()
    found = []
    for line in lines:
        if line.startswith("import time:") and line.count("|") == 2:
            _, cumulative, name = line.split("|")
            if cumulative.strip().isdigit():
                found.append((name.rstrip(), int(cumulative) / 1e6))
    return sorted(found, key=lambda item: -item[1])[:top]


def _tree_pss_kb(pid: int) -> int:
    """Pss_Anon + Pss_Shmem (kB) of ``pid`` and its descendants, now; 0 for what cannot be read."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            for line in Path(f"/proc/{current}/smaps_rollup").read_text().splitlines():
                if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return total


def _profile(run: dict) -> str:
    profile = run.get("profile")
    if not profile:
        return "- | - | - | - | - |"
    pipeline, marks = profile["pipeline"], profile["marks"]
    busy = "/".join(f"{pipeline['busy'][s]:.1f}" for s in ("read", "make", "write"))
    waited = "/".join(f"{pipeline['waited'][s]:.1f}" for s in ("read", "make", "write"))
    first = marks.get("first piece written")
    return (f"{first:.1f} | " if first is not None else "- | ") + (
        f"{pipeline['seconds']:.1f} | {marks['reported']:.1f} | {busy} | {waited} |"
    )


def sync_seconds() -> float:
    started = time.perf_counter()
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument(
        "--routes",
        default="dd,cuda,cpu,transformers,adapter,peft",
        help="dd, cuda, cpu, transformers, adapter, peft; a route may add environment variables "
        "(cuda+NF4CONVERT_SHARDS_AT_ONCE=1) and other code to run (cuda@DIR: nf4convert from DIR)",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="first convert a one-layer checkpoint of the same shapes "
        "once on each nf4convert route, untimed: Triton's cache filled, as after a user's first run (a route given "
        "its own "
        "TRITON_CACHE_DIR is not: cuda+TRITON_CACHE_DIR=/tmp/empty is a fresh machine's first run)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["bf16", "fp16"],
        help="the nf4convert routes' --dtype (default: the checkpoint's, bf16; dd writes as many bytes)",
    )
    parser.add_argument("--json")
    options = parser.parse_args()
    import torch

    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="nf4convert-bench-convert-"))
    source = workdir / "llama-8b-shaped-bnb-4bit"
    started = time.perf_counter()
    shutil.rmtree(source, ignore_errors=True)
    dense = build_source(source, options.layers)
    source_bytes = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    print(
        f"source: {source_bytes / 1e9:.2f} GB in {time.perf_counter() - started:.1f} s; dense output "
        f"{dense / 1e9:.2f} GB",
        flush=True,
    )

    adapter = workdir / "lora-r16"
    if "adapter" in options.routes or "peft" in options.routes:
        shutil.rmtree(adapter, ignore_errors=True)
        build_adapter(adapter, options.layers)
    module = [sys.executable, "-m", "nf4convert.cli.commands"]
    dtype = ["--dtype", options.dtype] if options.dtype else []
    cli = [*module, str(source), "-q", "--overwrite", *dtype, "-o"]
    routes = {
        "dd": lambda out: [
            "bash",
            "-c",
            f"mkdir -p {out} && dd if=/dev/zero of={out}/model.bin bs=64M iflag=count_bytes count={dense} status=none",
        ],
        "nf4convert cuda": lambda out: [*cli, str(out), "--device", "cuda"],
        "nf4convert cpu": lambda out: [*cli, str(out), "--device", "cpu"],
        "transformers": lambda out: [sys.executable, "-c", TRANSFORMERS_ROUTE, str(source), str(out)],
        "nf4convert cuda + adapter": lambda out: [*cli, str(out), "--device", "cuda", "--adapter", str(adapter)],
        "transformers + peft": lambda out: [sys.executable, "-c", PEFT_ROUTE, str(source), str(out), str(adapter)],
    }
    wanted = {
        "dd": "dd",
        "cuda": "nf4convert cuda",
        "cpu": "nf4convert cpu",
        "transformers": "transformers",
        "adapter": "nf4convert cuda + adapter",
        "peft": "transformers + peft",
    }
    chosen = []
    for route in options.routes.split(","):
        route, _, code = route.partition("@")
        base, *settings = route.split("+")
        if not (base in ("transformers", "peft") and options.no_transformers):
            env = dict(setting.split("=", 1) for setting in settings)
            if code:  # run from there too: `python -m` puts the current folder first on the path
                env["PYTHONPATH"] = f"{Path(code).resolve()}:{os.environ.get('PYTHONPATH', '')}"
                env["CWD"] = str(Path(code).resolve())
            label = (
                wanted[base]
                + "".join(
                    f" {k.removeprefix('NF4CONVERT_').lower()}={v}"
                    for k, v in env.items()
                    if k not in ("PYTHONPATH", "CWD")
                )
                + (f" ({Path(code).name})" if code else "")
            )
            label += " (again)" * sum(
                1 for c in chosen if c[0].removesuffix(" (again)") == label
            )  # dd twice: both rows
            chosen.append((label, wanted[base], env))
    if options.warm:
        example = workdir / "warm-source"
        build_source(example, 1, vocab_size=1024)
        for label, base, env in chosen:
            if (
                base.startswith("nf4convert") and "TRITON_CACHE_DIR" not in env
            ):  # its own cache: a fresh machine's first run
                device = "cuda" if "cuda" in base else "cpu"
                subprocess.run(
                    [
                        *module,
                        str(example),
                        "-q",
                        "--overwrite",
                        *dtype,
                        "-o",
                        str(workdir / "warm"),
                        "--device",
                        device,
                    ],
                    check=True,
                    env={**os.environ, **env},
                    cwd=env.get("CWD"),
                )
        shutil.rmtree(workdir / "warm", ignore_errors=True)
        shutil.rmtree(example, ignore_errors=True)
    results = {}
    for name, base, env in chosen:
        out = workdir / ("out-" + name.replace(" ", "-").replace("(", "").replace(")", ""))
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        env = {"NF4CONVERT_PROFILE": "1", **env}
        try:
            run = measure(routes[base](out), env, cwd=env.get("CWD"))
        except SystemExit as error:
            print(f"{name}: failed: {str(error)[-800:]}", flush=True)
            continue
        run["synced_seconds"] = run["seconds"] + sync_seconds()
        run["output_gb"] = sum(p.stat().st_size for p in out.iterdir() if p.is_file()) / 1e9
        results[name] = run
        print(name, json.dumps(run), flush=True)
        if (
            name.startswith("nf4convert cpu")
            and "nf4convert cuda" in results
            and (workdir / "out-nf4convert-cuda").exists()
        ):
            cuda_out = workdir / "out-nf4convert-cuda"
            same = all(
                subprocess.run(["cmp", "-s", str(path), str(out / path.name)]).returncode == 0
                for path in sorted(cuda_out.glob("*.safetensors"))
            )
            results[name]["identical_to_cuda"] = same
            print(f"cuda and {name.removeprefix('nf4convert ')} outputs identical: {same}", flush=True)
        if name != "nf4convert cuda" or not any(c[0].startswith("nf4convert cpu") for c in chosen):
            shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(workdir / "out-nf4convert-cuda", ignore_errors=True)

    import transformers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(
        f"\n{gpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}, {datetime.date.today().isoformat()}; {options.layers} layers, "
        f"{dense / 1e9:.2f} GB of bf16 out"
    )
    print(
        "| route | s (exit) | GB/s | x dd | s (+sync) | GB/s | x dd | peak RssAnon | peak Pss with children | first "
        "write at s | pipeline s | done at s "
        "| busy r/m/w s | waited r/m/w s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    dds = [
        r for name, r in results.items() if name.startswith("dd")
    ]  # `dd` moves within a run: x dd is against its fastest
    dd = {k: min(r[k] for r in dds) for k in ("seconds", "synced_seconds")} if dds else None
    for name, r in results.items():
        ratio = f"{r['seconds'] / dd['seconds']:.2f}" if dd else "-"
        ratio_synced = f"{r['synced_seconds'] / dd['synced_seconds']:.2f}" if dd else "-"
        print(
            f"| {name} | {r['seconds']:.1f} | {dense / 1e9 / r['seconds']:.2f} | {ratio} | {r['synced_seconds']:.1f} | "
            f"{dense / 1e9 / r['synced_seconds']:.2f} | {ratio_synced} | {r['peak_anon_mb']:.0f} MB | "
            f"{r['peak_tree_pss_mb']:.0f} MB | {_profile(r)}"
        )
    if options.json:
        Path(options.json).write_text(json.dumps({"gpu": gpu, "dense_bytes": dense, "results": results}, indent=1))
    if options.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
