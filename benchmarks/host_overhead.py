"""Host (CPU) microseconds per call of each step of an eager dequantize_4bit on a GPU.

    python benchmarks/host_overhead.py

do_bench hides host time behind its L2-flush memset, so this times the Python side directly:
a tiny weight (the GPU finishes each kernel long before the next launch), N calls, one sync.
"""

import time

import torch

import nf4convert
from nf4convert import dequantize as api
from nf4convert.kernels import launch


def per_call(fn, calls=5000):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main():
    import bitsandbytes.functional as F

    weight = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda")
    packed, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    nf4convert.dequantize_4bit(packed, state)
    entry = api._replays._entries[id(state)]
    out = torch.empty(tuple(state.shape), dtype=state.dtype, device="cuda")
    steps = {
        "dequantize_4bit (replayed)": lambda: nf4convert.dequantize_4bit(packed, state),
        "dequantize_4bit (full path, no replay)": lambda: (
            api._replays.clear(),
            nf4convert.dequantize_4bit(packed, state),
        ),
        "torch.empty": lambda: torch.empty(entry.key.shape, dtype=entry.key.dtype, device=entry.key.device),
        "replay cache (checks, empty, launch)": lambda: api._replays.replay(packed, state),
        "torch.cuda.current_device": torch.cuda.current_device,
        "hooks check": launch._hooks_active,
        "replay (launch only)": lambda: entry.replay(out),
        "torch.compiler.is_compiling": torch.compiler.is_compiling,
    }
    for name, fn in steps.items():
        print(f"{name:42s} {per_call(fn):7.2f} us")
    nf4convert.dequantize_4bit(packed, state)


def profile_replayed():
    """cProfile of the replayed path: which Python calls the host time goes to."""
    import cProfile
    import pstats

    import bitsandbytes.functional as F

    weight = torch.randn(64, 256, dtype=torch.bfloat16, device="cuda")
    packed, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    nf4convert.dequantize_4bit(packed, state)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(2000):
        nf4convert.dequantize_4bit(packed, state)
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    import sys

    profile_replayed() if "--profile" in sys.argv else main()
