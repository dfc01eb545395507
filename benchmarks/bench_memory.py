"""Peak memory and wall time of a CPU conversion: nf4convert against transformers' own route.

    python benchmarks/bench_memory.py [--workdir DIR] [--keep]

Builds a ~0.6B-parameter Llama-shaped 4-bit checkpoint (hidden 1024, intermediate 4096, 28 layers,
vocab 32000; NF4 with double quantization, bf16; 1.07 GB of bf16 output) with transformers +
bitsandbytes on the CPU, then converts it twice, each in a fresh process:

  nf4convert     nf4convert SOURCE -o OUT --device cpu
  transformers   from_pretrained(SOURCE) -> model.dequantize() -> save_pretrained(OUT, save_original_format=False)

and samples each process's anonymous resident memory (RssAnon in /proc/PID/status: the heap,
Python and torch included; the page cache and mapped files are not counted) every 5 ms.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from bench_convert import measure  # one sampler of wall time and peak RssAnon/VmRSS for both benchmarks

TRANSFORMERS_ROUTE = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="cpu")
model = model.dequantize()
model.save_pretrained(sys.argv[2], save_original_format=False)
"""


def build_source(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
    )
    with tempfile.TemporaryDirectory(dir=folder.parent) as dense:
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(dense)
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        model = AutoModelForCausalLM.from_pretrained(
            dense, quantization_config=quantization, dtype=torch.bfloat16, device_map="cpu"
        )
        model.save_pretrained(folder)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the built checkpoint and outputs")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each route, alternating; medians reported")
    options = parser.parse_args()
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="nf4convert-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    source = workdir / "llama-0.6b-bnb-4bit"
    if not (source / "config.json").exists():
        print("building the 4-bit source checkpoint ...", flush=True)
        build_source(source)
    routes = {
        "nf4convert": [
            sys.executable,
            "-m",
            "nf4convert.cli.commands",
            str(source),
            "-o",
            str(workdir / "out-nf4convert"),
            "--device",
            "cpu",
            "-q",
            "--overwrite",
        ],
        "transformers": [sys.executable, "-c", TRANSFORMERS_ROUTE, str(source), str(workdir / "out-transformers")],
    }
    runs = {name: [] for name in routes}
    for _ in range(options.repeat):
        for name, command in routes.items():  # alternating, so both see the same disk and cache state
            shutil.rmtree(workdir / f"out-{name}", ignore_errors=True)
            run = measure(command)
            run["output_gb"] = sum(p.stat().st_size for p in (workdir / f"out-{name}").glob("*.safetensors")) / 1e9
            runs[name].append(run)
            print(name, json.dumps(run), flush=True)
    results = {
        name: {key: statistics.median(run[key] for run in measured) for key in measured[0]}
        for name, measured in runs.items()
    }
    import torch
    import transformers

    print(
        f"\n{platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores, torch "
        f"{torch.__version__}, "
        f"transformers {transformers.__version__}, "
        f"Python {platform.python_version()}, {datetime.date.today().isoformat()}"
    )
    print(f"medians of {options.repeat} runs each")
    print("| route | peak anonymous memory | peak RSS | wall time | output |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['peak_anon_mb']:.0f} MB | {r['peak_rss_mb']:.0f} MB | {r['seconds']:.1f} s | "
            f"{r['output_gb']:.2f} GB |"
        )
    ours, theirs = results["nf4convert"], results["transformers"]
    print(
        f"nf4convert: {ours['peak_anon_mb'] / theirs['peak_anon_mb']:.2f}x the memory, "
        f"{ours['seconds'] / theirs['seconds']:.2f}x the time"
    )
    if not options.keep and options.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
