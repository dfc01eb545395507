"""The exact CPU path against bitsandbytes' own CPU op (which is not exact: README, "What it computes"), one weight.

    python3 benchmarks/bench_cpu_path.py

A 4096x4096 bf16 weight quantized by bitsandbytes (NF4, double quantization, blocksize 64); the median of 15 calls
of each, after one warm-up call, on the threads torch uses by default.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time

import bitsandbytes
import bitsandbytes.functional as F
import torch

from nf4convert import dequantize_4bit


def _median_ms(function, calls: int = 15) -> float:
    function()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.manual_seed(0)
    weight = torch.randn(4096, 4096, dtype=torch.bfloat16)
    packed, state = F.quantize_4bit(weight, quant_type="nf4", compress_statistics=True, blocksize=64)
    ours = _median_ms(lambda: dequantize_4bit(packed, state, backend="cpu"))
    theirs = _median_ms(lambda: F.dequantize_4bit(packed, state))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"{platform.processor() or platform.machine()}, {cores} cores, torch {torch.__version__}, bitsandbytes "
        f"{bitsandbytes.__version__}, {datetime.date.today()}"
    )
    print(
        f"4096x4096 NF4 (double quantization, blocksize 64) -> bf16, median of 15 calls: nf4convert backend='cpu' "
        f"{ours:.1f} ms; bitsandbytes.functional.dequantize_4bit on the CPU {theirs:.1f} ms"
    )


if __name__ == "__main__":
    main()
