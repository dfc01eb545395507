"""The GGUF quantizers' CPU throughput on one core: MB/s of float32 input, for every registered type, without and
with an importance matrix, beside llama.cpp's own single-threaded ``ggml_quantize_chunk`` (the tests' reference
harness, built from the pinned sdist) on the same rows.

    python benchmarks/bench_gguf_quants.py [--rows 512] [--width 4096] [--types Q4_K,Q6_K] [--no-c]

Rows are bf16-rounded normal values (what the two-step route quantizes); the imatrix is squared normals. Times are
the process's CPU time (``time.process_time``), so other work on a shared machine weighs less; the C figure is the
harness's wall time less its start-up (a run on one row), single-threaded.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nf4convert.sinks.gguf.quants import QUANTS, quant_type  # noqa: E402


def _bf16(values):
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def _ours(kind, rows, imatrix):
    kind.quantize(rows[:8], imatrix)
    start = time.process_time()
    kind.quantize(rows, imatrix)
    return rows.nbytes / (time.process_time() - start) / 1e6


def _theirs(ref, kind, rows, imatrix):
    def timed(part):
        start = time.perf_counter()
        ref.quantize_chunk(kind.type_id, part, imatrix)
        return time.perf_counter() - start

    overhead = min(timed(rows[:1]) for _ in range(3))
    return rows.nbytes / max(timed(rows) - overhead, 1e-9) / 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--types", default=",".join(sorted(QUANTS.discovered())))
    parser.add_argument("--no-c", action="store_true", help="skip llama.cpp's own quantizer")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = _bf16(rng.standard_normal((args.rows, args.width)) * 0.02)
    imatrix = (rng.standard_normal(args.width) ** 2).astype(np.float32)
    ref = None
    if not args.no_c:
        from tests.fixtures.llama_cpp import LlamaCpp

        ref = LlamaCpp.ready()
    print(f"rows {args.rows} x {args.width} float32 ({rows.nbytes / 1e6:.0f} MB); MB/s of input, one core")
    print(f"{'type':8s} {'ours':>8s} {'ours+im':>8s}" + ("" if ref is None else f" {'C':>8s} {'C+im':>8s}"))
    for name in args.types.split(","):
        kind = quant_type(name)
        line = f"{kind.name:8s} {_ours(kind, rows, None):8.1f} {_ours(kind, rows, imatrix):8.1f}"
        if ref is not None:
            line += f" {_theirs(ref, kind, rows, None):8.1f} {_theirs(ref, kind, rows, imatrix):8.1f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
