"""Why fp16 results take torch's conversion on the CPU route (kernels/cpu.uses_torch): numpy's fp32 -> fp16 cast
against torch's, on values whose fp16 results are normal and on values whose results are fp16 subnormals.

    python3 benchmarks/bench_fp16_cast.py

Best of 5 rounds of 20 casts of 2^21 elements each (8 MiB of fp32), one torch thread; ns per element.
"""

from __future__ import annotations

import datetime
import os
import platform
import time

import numpy as np
import torch


def best(work, rounds=5, calls=20) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            work()
        times.append((time.perf_counter() - started) / calls)
    return min(times)


def main() -> None:
    torch.set_num_threads(1)
    n = 1 << 21
    rng = np.random.default_rng(0)
    normal = ((rng.random(n, dtype=np.float32) - 0.5) * 0.1).astype(np.float32)  # fp16 normals (|x| >= 6.1e-5 mostly)
    subnormal = normal * np.float32(1e-6)  # fp16 subnormals
    out = np.empty(n, dtype=np.float16)
    print(
        f"{platform.machine()}, {os.cpu_count()} cores, numpy {np.__version__}, torch {torch.__version__}, "
        f"{datetime.date.today()}"
    )
    for name, values in (("normal results", normal), ("fp16-subnormal results", subnormal)):
        numpy_s = best(lambda: np.copyto(out, values, casting="unsafe"))
        source, target = torch.from_numpy(values), torch.from_numpy(out)
        torch_s = best(lambda: target.copy_(source))
        print(
            f"{name}: numpy {numpy_s / n * 1e9:.2f} ns/element, torch {torch_s / n * 1e9:.3f} ns/element, "
            f"numpy/torch {numpy_s / torch_s:.0f}x"
        )


if __name__ == "__main__":
    main()
