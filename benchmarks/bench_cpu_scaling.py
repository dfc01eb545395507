"""How the CPU route's 4-bit decode scales over cores: the pieces the route makes (1 MiB packed, 4 MiB of bf16
out), taken by N threads from one weight, as CpuRoute's makers take them; aggregate GB/s of output.

    python3 benchmarks/bench_cpu_scaling.py [--threads 1,4,8,16] [--chunks 4194304,131072] [--packed-mib 512]
                                            [--processes 8,12] [--process-chunks 32768,4194304]

Rows: the route's whole make (argument checks, nested absmax decode, kernel) at each kernel chunk size, the
kernel alone, and a cast of fp32 to the same bf16 bytes (the kernel's last pass alone), on threads; with
``--processes 8,12``, the make as the route makes it in its worker processes (workers.py), at each of
``--process-chunks``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default=None, help="comma-separated thread counts (default 1, half, all cores)")
    parser.add_argument("--chunks", default="4194304,131072,32768", help="kernel chunk sizes, packed bytes")
    parser.add_argument("--packed-mib", type=int, default=512, help="the weight's packed size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--processes",
        default="",
        help="comma-separated worker-process counts: pieces made as the "
        "route makes them in worker processes (empty: none)",
    )
    parser.add_argument("--process-chunks", default="32768,4194304", help="kernel chunk sizes in the worker processes")
    args = parser.parse_args()

    import numpy as np

    from nf4convert.formats import bnb4
    from nf4convert.kernels import cpu
    from nf4convert.kinds import dequantize_4bit
    from nf4convert.pipeline.routes.cpu import CPU_PIECE_BYTES, CpuRoute

    cores = len(os.sched_getaffinity(0))
    counts = [int(x) for x in args.threads.split(",")] if args.threads else sorted({1, max(1, cores // 2), cores})
    rng = np.random.default_rng(0)
    n_packed = args.packed_mib << 20
    n = 2 * n_packed
    blocksize, nested_blocksize = 64, 256
    packed = rng.integers(0, 256, n_packed, dtype=np.uint8)
    absmax = rng.integers(0, 256, n // blocksize, dtype=np.uint8)
    state = bnb4.QuantState4bit(
        absmax=absmax,
        shape=(n,),
        dtype="BF16",
        blocksize=blocksize,
        quant_type="nf4",
        offset=0.03,
        state2=bnb4.NestedState(
            rng.random(-(-absmax.size // nested_blocksize), dtype=np.float32) + 0.5,
            np.linspace(-1, 1, 256, dtype=np.float32),
            nested_blocksize,
        ),
    )
    pieces = list(bnb4.chunks(state, CPU_PIECE_BYTES // 2))
    route = CpuRoute(processes=0)  # the threads' rows: every make on the calling thread
    code = np.float32(bnb4.CODES["nf4"])

    def run(threads: int, work) -> float:
        return _in_threads(threads, len(pieces), lambda: np.empty(CPU_PIECE_BYTES, dtype=np.uint8), work)

    def route_make(index, out):
        first, count, piece = pieces[index]
        make = route.make(functools.partial(dequantize_4bit.dequantize_on_host, state=piece))
        make(packed[first // 2 : first // 2 + (count + 1) // 2], out[: 2 * count])

    def kernel_only(index, out):
        first, count, piece = pieces[index]
        scale_state = piece.state2
        cpu.dequantize(
            packed[first // 2 : first // 2 + (count + 1) // 2],
            piece.absmax,
            scale_state.code,
            scale_state.absmax,
            piece.offset,
            code,
            out[: 2 * count],
            "BF16",
            blocksize,
            nested_blocksize,
        )

    source = np.zeros(CPU_PIECE_BYTES // 2, dtype=np.float32)

    def copy_only(index, out):  # read 4 bytes, write 2, per element: the kernel's last pass alone
        cpu.store(source, out.view(np.uint16), "BF16", nan=False)

    results = []
    print(f"cores={cores} numpy={np.__version__} pieces={len(pieces)} out_gb={2 * n / 1e9:.2f}")
    for threads in counts:
        rows = [("copy", None, copy_only)]
        for chunk in [int(x) for x in args.chunks.split(",")]:
            rows += [("route", chunk, route_make), ("kernel", chunk, kernel_only)]
        for name, chunk, work in rows:
            if chunk is not None:
                cpu.CHUNK_BYTES = chunk
            best = min(run(threads, work) for _ in range(args.repeats))
            row = {"threads": threads, "what": name, "chunk": chunk, "seconds": best, "out_gbps": 2 * n / best / 1e9}
            results.append(row)
            print(json.dumps(row), flush=True)
    for processes in [int(x) for x in args.processes.split(",") if x]:
        for chunk in [int(x) for x in args.process_chunks.split(",")]:
            cpu.PROCESS_CHUNK_BYTES = chunk  # what the workers forked next take as their chunk
            best = min(
                _in_processes(processes, pieces, packed, code, blocksize, nested_blocksize) for _ in range(args.repeats)
            )
            row = {
                "threads": f"{processes} processes",
                "what": "route",
                "chunk": chunk,
                "seconds": best,
                "out_gbps": 2 * n / best / 1e9,
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    print("| threads | what | chunk (packed bytes) | s | GB/s out |")
    print("|---|---|---|---|---|")
    for row in results:
        print(
            f"| {row['threads']} | {row['what']} | {row['chunk'] or '-'} | {row['seconds']:.3f} | "
            f"{row['out_gbps']:.2f} |"
        )


def _in_processes(processes, pieces, packed, code, blocksize, nested_blocksize) -> float:
    """The pieces made as the CPU route makes them in worker processes (nf4convert/workers.py): each of
    ``processes`` threads copies a piece's packed bytes into its slot of the shared mapping (as a reader would) and
    hands the piece to a worker, which decodes it into another slot; ``code``, ``blocksize`` and the nested
    blocksize come with each piece's quant state."""
    from nf4convert.kinds.dequantize_4bit import dequantize_on_host
    from nf4convert.pipeline.routes.cpu import CPU_PIECE_BYTES
    from nf4convert.pipeline.routes.workers import Workers

    workers = Workers(processes, 2 * processes, CPU_PIECE_BYTES)

    def feed(index: int, slots) -> None:
        read, out = slots
        first, count, piece = pieces[index]
        n_packed = (count + 1) // 2
        read[:n_packed] = packed[first // 2 : first // 2 + n_packed]
        workers.run(functools.partial(dequantize_on_host, state=piece), read[:n_packed], out[: 2 * count])

    seconds = _in_threads(
        processes, len(pieces), lambda: (workers.slot(CPU_PIECE_BYTES), workers.slot(CPU_PIECE_BYTES)), feed
    )
    workers.close()
    return seconds


def _in_threads(threads: int, n_pieces: int, own, work) -> float:
    """Seconds for ``threads`` threads to take pieces 0..n_pieces-1 in turn, each calling ``work(index, mine)`` with
    ``mine = own()``, made once per thread."""
    turn = iter(range(n_pieces))
    lock = threading.Lock()

    def taker() -> None:
        mine = own()
        while True:
            with lock:
                index = next(turn, None)
            if index is None:
                return
            work(index, mine)

    takers = [threading.Thread(target=taker) for _ in range(threads)]
    started = time.perf_counter()
    for thread in takers:
        thread.start()
    for thread in takers:
        thread.join()
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
