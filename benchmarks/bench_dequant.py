"""Kernel time of every NF4 dequantize we know, same weights, one run; a table last.

    PYTHONPATH=path/to/unsloth_kernels python benchmarks/bench_dequant.py [--quick] [--json FILE]

Methods: bitsandbytes' dequantize_4bit; Unsloth's original path (bitsandbytes' C kernels through
ctypes); Unsloth's current fused Triton kernel (when importable); ours eager; ours under
torch.compile; and our launch-config variants (bytes per program, warps, eviction hints).
Weights: double-quantized NF4, blocksize 64, quantized by bitsandbytes. Times: median of
triton.testing.do_bench (with --rounds R: the median of R rounds, the methods' order rotated each round).
With --timer graph, each method's calls are instead captured in one CUDA graph, over enough distinct copies of the
weight (inputs and outputs) that they span three times the L2 cache, and the graph's replay timed with CUDA events:
the time per call with no launch cost (replays are queued behind a running one) and no timer step (do_bench's
events resolve ~0.6 us, a few % of a middle weight), every method alike.
Floor: bytes that must move (packed + absmax + nested absmax + output) over the device-to-device copy bandwidth
measured in the same run. Expand: the best of a few launch configs of a kernel that moves the same bytes (one
packed byte in, four out, eight for fp32) and decodes nothing; writes: the same kernel's writes alone.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import datetime
import json
import platform
import statistics
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

SHAPES = [(1024, 1024), (4096, 1024), (4096, 4096), (8192, 2048), (14336, 4096), (28672, 8192)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# Launch variants (nf4convert.kernels.configs.Config fields) measured beside the default choice.
VARIANTS = {
    "t1k.w4.ev": dict(tile_bytes=1024, num_warps=4, evict=True),
    "t2k.w4.ev": dict(tile_bytes=2048, num_warps=4, evict=True),
    "t2k.w4": dict(tile_bytes=2048, num_warps=4, evict=False),
    "t2k.w4.cs": dict(tile_bytes=2048, num_warps=4, evict=False, streaming_stores=True),
    "t2k.w4.noptx": dict(tile_bytes=2048, num_warps=4, evict=False, ptx=False),
    "t2k.w8.noptx": dict(tile_bytes=2048, num_warps=8, evict=False, ptx=False),
    "t2k.w8": dict(tile_bytes=2048, num_warps=8, evict=False),
    "t4k.w8": dict(tile_bytes=4096, num_warps=8, evict=False),
    "t512.w2": dict(tile_bytes=512, num_warps=2, evict=False),
    "sel.t1k.w4": dict(tile_bytes=1024, num_warps=4, evict=False, lut_select=True),
    "pers4.t2k": dict(tile_bytes=2048, num_warps=4, evict=False, programs_per_sm=4, stages=1),
    "t4k.w4.ev": dict(tile_bytes=4096, num_warps=4, evict=True),
    "t2k.w8.ev": dict(tile_bytes=2048, num_warps=8, evict=True),
}
# --variants grid: every tile size and warp count (plain and streaming stores), for choosing a GPU's table.
GRID = {
    f"t{tile // 1024 or 0.5}k.w{warps}{'.cs' if cs else ''}": dict(
        tile_bytes=tile, num_warps=warps, evict=False, streaming_stores=cs
    )
    for tile in (1024, 2048, 4096, 8192)
    for warps in (2, 4, 8)
    for cs in (False, True)
}
# --variants evgrid: the same with evict_first hints (what the default table uses above 2 MiB packed).
EV_GRID = {
    f"t{tile // 1024}k.w{warps}.ev": dict(tile_bytes=tile, num_warps=warps, evict=True)
    for tile in (1024, 2048, 4096, 8192)
    for warps in (2, 4, 8)
}
# --variants persistent: fixed grids of 2-16 programs per SM looping over tiles, with the hints.
PERSISTENT = {
    f"pers{per_sm}.t{tile // 1024}k.w4.ev": dict(tile_bytes=tile, num_warps=4, evict=True, programs_per_sm=per_sm)
    for per_sm in (2, 4, 8, 16)
    for tile in (2048, 4096)
}
HARNESS = [
    (2, 3333, 2048, 8192, torch.float16),
    (5, 777, 1024, 4096, torch.bfloat16),
    (3, 2048, 4096, 14336, torch.bfloat16),
]


def variant_set(text):
    """--variants: a named set, or variant names from every set, comma-separated."""
    sets = {"default": VARIANTS, "grid": GRID, "evgrid": EV_GRID, "persistent": PERSISTENT, "none": {}}
    if text in sets:
        return sets[text]
    known = {**VARIANTS, **GRID, **EV_GRID, **PERSISTENT}
    unknown = [name for name in text.split(",") if name not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown variant {unknown[0]!r}: one of {', '.join(sets)} or names such as {', '.join(list(EV_GRID)[:3])}"
        )
    return {name: known[name] for name in text.split(",")}


def _ptr(tensor):
    return ctypes.c_void_p(tensor.data_ptr())


def make_methods():
    import bitsandbytes.functional as F
    from bitsandbytes.cextension import lib

    import nf4convert

    methods = {"bnb": lambda packed, state: F.dequantize_4bit(packed, state)}

    def bnb_ctypes(packed, state):
        # Unsloth's fast_dequantize before its fused kernel: bnb's C kernels, absmax in a scratch buffer.
        out = torch.empty(state.shape, dtype=state.dtype, device=packed.device)
        n_absmax = state.absmax.numel()
        absmax = torch.empty(n_absmax, dtype=torch.float32, device=packed.device)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        lib.cdequantize_blockwise_fp32(
            _ptr(state.state2.code),
            _ptr(state.absmax),
            _ptr(state.state2.absmax),
            _ptr(absmax),
            ctypes.c_int(state.state2.blocksize),
            ctypes.c_int(n_absmax),
            stream,
        )
        absmax += state.offset
        name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[state.dtype]
        getattr(lib, f"cdequantize_blockwise_{name}_nf4")(
            None,
            _ptr(packed),
            _ptr(absmax),
            _ptr(out),
            ctypes.c_int(state.blocksize),
            ctypes.c_int(out.numel()),
            stream,
        )
        return out

    methods["bnb_ctypes"] = bnb_ctypes
    try:
        from unsloth.kernels.nf4 import dequantize_nf4

        def unsloth(packed, state):
            return dequantize_nf4(
                packed,
                state.absmax,
                state.state2.code,
                state.state2.absmax,
                state.offset,
                state.code,
                state.blocksize,
                state.state2.blocksize,
                state.shape,
                state.dtype,
            )

        methods["unsloth_fused"] = unsloth
    except Exception as error:  # noqa: BLE001  (a peer that is not there is reported, not fatal)
        print(f"Unsloth's fused kernel not importable ({type(error).__name__}: {error}); column skipped")
    methods["ours"] = lambda packed, state: nf4convert.dequantize_4bit(packed, state)
    methods["ours_compiled"] = None  # compiled afresh for every shape and dtype, see main()
    return methods


def compiled_ours():
    import nf4convert

    torch._dynamo.reset()
    return torch.compile(lambda packed, state: nf4convert.dequantize_4bit(packed, state), fullgraph=True, dynamic=False)


def set_compiled(methods):
    methods["ours_compiled"] = compiled_ours()


def host_us(fn, packed, state, calls=2000):
    """Host time per call (no synchronize): what the launch path costs the CPU."""
    for _ in range(10):
        fn(packed, state)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(packed, state)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def with_variant(fields, fn):
    from nf4convert.kernels import configs

    config = configs.Config(**fields)

    def run(packed, state):
        with configs.override(config):
            return fn(packed, state)

    return run


@triton.jit
def _touch_kernel(out_ptr):
    tl.store(out_ptr + tl.arange(0, 128), tl.zeros([128], dtype=tl.float32))


@triton.jit
def _expand_kernel(source, target, BLOCK: tl.constexpr):
    # The dequantize kernel's traffic with no decode: each packed byte read, 4 (or 8) bytes written.
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    byte = tl.load(source + offsets)
    tl.store(target + offsets, byte.to(target.dtype.element_ty) * 0x01010101)


@triton.jit
def _write_kernel(target, BLOCK: tl.constexpr):
    # Only the output's writes: what the dequantize kernel's stores alone cost.
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(target + offsets, tl.zeros([BLOCK], dtype=target.dtype.element_ty))


SAME_TRAFFIC_CONFIGS = [(block, warps) for block in (1024, 2048, 4096, 8192) for warps in (4, 8)]


def expand_us(packed, out_bytes, write_only=False, copies=0):
    """The best time over launch configs of a kernel that moves what dequantize moves (packed in; 4 bytes per
    packed byte out for 16-bit outputs, 8 for fp32) and decodes nothing: how close to the copy floor this mix of reads
    and writes can get. ``write_only``: the output's writes alone, no reads. ``copies``: timed as ``graph_us`` over
    that many copies of its input and output instead of by do_bench."""
    source = packed.view(-1)
    per_byte = out_bytes // source.numel()
    if per_byte not in (4, 8) or out_bytes != per_byte * source.numel():
        return None
    target = torch.empty(source.numel(), dtype=torch.int32 if per_byte == 4 else torch.int64, device="cuda")
    best = None
    for block, warps in SAME_TRAFFIC_CONFIGS:
        if source.numel() % block:
            continue  # this config would need masks: not the plain traffic
        grid = (source.numel() // block,)

        def call(source=source, target=target, block=block, warps=warps):
            if write_only:
                _write_kernel[grid](target, BLOCK=block, num_warps=warps)
            else:
                _expand_kernel[grid](source, target, BLOCK=block, num_warps=warps)
            return target

        if copies:
            pairs = [(source.clone(), torch.empty_like(target)) for _ in range(copies)]
            us = graph_us([lambda pair=pair: call(*pair) for pair in pairs])
            del pairs
        else:
            us = do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3
        if us is None:
            continue
        best = us if best is None else min(best, us)
    return best


def weight_copies(packed, state, count):
    """``count`` independent copies of a quantized weight (packed bytes and every quant-state tensor)."""
    copies = []
    for _ in range(count):
        state2 = copy.copy(state.state2)
        state2.absmax, state2.code = state.state2.absmax.clone(), state.state2.code.clone()
        twin = copy.copy(state)
        twin.absmax, twin.code, twin.offset, twin.state2 = (
            state.absmax.clone(),
            state.code.clone(),
            state.offset.clone(),
            state2,
        )
        copies.append((packed.clone(), twin))
    return copies


def copies_needed(packed, state):
    """Copies of a weight whose bytes (packed in, output out) span three times the L2 cache: cold for every call."""
    out_bytes = state.shape.numel() * state.dtype.itemsize
    l2 = torch.cuda.get_device_properties(packed.device).L2_cache_size
    return max(4, min(256, -(-3 * l2 // (out_bytes + packed.numel()))))


def graph_us(calls, replays=15, per_timing=3):
    """Microseconds per call of the zero-argument ``calls``, captured in one CUDA graph (every output kept, so each
    call writes fresh memory) and replayed; median over ``replays`` timings. Each timing spans ``per_timing`` replays
    queued behind one untimed replay, so the GPU never waits for a launch inside it. None when they cannot be
    captured."""
    for call in calls:
        call()  # compile, and fill any launch cache, before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            outputs = [call() for call in calls]
    except Exception as error:  # noqa: BLE001  (a method that cannot be captured: no figure, said so)
        print(f"  not capturable: {type(error).__name__}: {str(error)[:120]}", flush=True)
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for timing in range(replays + 2):
        graph.replay()  # the GPU works on this one while the timed replays are queued behind it
        start.record()
        for _ in range(per_timing):
            graph.replay()
        end.record()
        end.synchronize()
        if timing >= 2:
            times.append(start.elapsed_time(end) * 1e3 / (per_timing * len(calls)))
    del outputs, graph
    return statistics.median(times)


def launch_floor_us():
    """do_bench of a one-program kernel that stores 512 bytes: what any launch costs in this harness."""
    out = torch.empty(128, dtype=torch.float32, device="cuda")
    return do_bench(lambda: _touch_kernel[(1,)](out), warmup=25, rep=200, return_mode="median") * 1e3


def copy_bandwidth():
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    ms = do_bench(lambda: target.copy_(source), warmup=50, rep=300, return_mode="median")
    return 2 * source.numel() / (ms * 1e-3)


def quantized(shape, dtype):
    import bitsandbytes.functional as F

    weight = torch.randn(shape, dtype=dtype, device="cuda") * 0.02
    return F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)


def moved_bytes(packed, state):
    out_bytes = state.shape.numel() * state.dtype.itemsize
    return packed.numel() * packed.element_size() + state.absmax.numel() + 4 * state.state2.absmax.numel() + out_bytes


def exact(out, reference):
    integer = {2: torch.int16, 4: torch.int32}[reference.element_size()]
    return torch.equal(out.reshape(-1).view(integer), reference.reshape(-1).view(integer))


def main():
    import bitsandbytes
    import bitsandbytes.functional as F

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and no harness")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--harness-iterations", type=int, default=1000)
    parser.add_argument("--shapes", help="e.g. 1024x1024,28672x8192 (default: all)")
    parser.add_argument("--dtypes", help="e.g. bf16,fp16 (default: all)")
    parser.add_argument("--no-harness", action="store_true")
    parser.add_argument(
        "--rounds", type=int, default=1, help="time every method this many times, interleaved; report the median"
    )
    parser.add_argument(
        "--timer",
        choices=("do_bench", "graph"),
        default="do_bench",
        help="do_bench per call (L2 flushed), or calls captured in a CUDA graph over cold copies",
    )
    parser.add_argument(
        "--variants",
        default="default",
        type=variant_set,
        help="the launch variants measured beside ours: a few (default), every tile x warps (grid; "
        "evgrid: with evict_first hints; persistent: fixed grids), none, or names from those, comma-separated "
        "(t4k.w8.ev,t2k.w8)",
    )
    options = parser.parse_args()

    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write)", flush=True)
    env["launch_floor_us"] = launch_floor_us()
    env["rounds"] = options.rounds
    env["timer"] = options.timer
    print(f"one-program kernel under do_bench: {env['launch_floor_us']:.1f} us", flush=True)

    methods = make_methods()
    for name, config in options.variants.items():
        methods[f"ours[{name}]"] = with_variant(config, methods["ours"])
    shapes = SHAPES[::2] if options.quick else SHAPES
    if options.shapes:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in options.shapes.split(",")]
    dtypes = {name: DTYPES[name] for name in options.dtypes.split(",")} if options.dtypes else DTYPES
    rows = []
    for shape in shapes:
        for dtype_name, dtype in dtypes.items():
            packed, state = quantized(shape, dtype)
            reference = F.dequantize_4bit(packed, state)
            floor_us = moved_bytes(packed, state) / bandwidth * 1e6
            row = {"shape": f"{shape[0]}x{shape[1]}", "dtype": dtype_name, "floor_us": floor_us}
            n_copies = copies_needed(packed, state) if options.timer == "graph" else 0
            out_bytes = state.shape.numel() * dtype.itemsize
            row["expand_us"] = expand_us(packed, out_bytes, copies=n_copies)
            row["write_us"] = expand_us(packed, out_bytes, write_only=True, copies=n_copies)
            set_compiled(methods)
            names = list(methods)
            copies = weight_copies(packed, state, n_copies) if n_copies else None
            if copies:
                row["copies"] = len(copies)
            for name, fn in methods.items():
                row[name] = {"exact": exact(fn(packed, state), reference), "rounds": []}
                if shape == shapes[0] and not name.startswith("ours["):
                    row[name]["host_us"] = host_us(fn, packed, state)
            for round_ in range(options.rounds):
                for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                    fn = methods[name]
                    if copies:
                        us = graph_us([lambda p=p, s=s: fn(p, s) for p, s in copies])
                    else:
                        us = do_bench(lambda: fn(packed, state), warmup=25, rep=100, return_mode="median") * 1e3
                    if us is not None:
                        row[name]["rounds"].append(us)
            for name in names:
                row[name]["us"] = statistics.median(row[name]["rounds"]) if row[name]["rounds"] else None
            rows.append(row)
            print(json.dumps(row), flush=True)
            del packed, state, reference, copies

    harness = {}
    if not options.quick and not options.no_harness:
        weights = []
        for _, _, hidden, intermediate, dtype in HARNESS:
            for shape in ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate)):
                weights.append(quantized(shape, dtype))
        set_compiled(methods)
        torch._dynamo.config.recompile_limit = 64  # one graph per harness weight shape
        for name, fn in methods.items():
            if name.startswith("ours["):
                continue
            for packed, state in weights:
                fn(packed, state)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(options.harness_iterations):
                for packed, state in weights:
                    fn(packed, state)
                    torch.cuda.synchronize()
            harness[name] = time.perf_counter() - start
        print(json.dumps({"harness_seconds": harness}), flush=True)

    if options.json:
        with open(options.json, "w") as file:
            json.dump({"env": env, "bandwidth": bandwidth, "rows": rows, "harness": harness}, file, indent=1)
    print_table(env, bandwidth, rows, harness)


def print_table(env, bandwidth, rows, harness):
    names = [n for n in rows[0] if isinstance(rows[0][n], dict)]
    peers = [n for n in ("bnb", "bnb_ctypes", "unsloth_fused") if n in names]
    print(
        f"\n{env['gpu']}, torch {env['torch']}, Triton {env['triton']}, bitsandbytes {env['bitsandbytes']}, "
        f"{env['date']}; copy bandwidth {bandwidth / 1e9:.0f} GB/s; one-program kernel {env['launch_floor_us']:.1f} "
        "us; "
        f"median us ({env.get('timer', 'do_bench')}, {env.get('rounds', 1)} round(s)); * = not bit-exact"
    )
    header = ["shape", "dtype", "floor", "expand", "writes"] + names + [f"ours/{p}" for p in peers] + ["ours %floor"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [
            row["shape"],
            row["dtype"],
            f"{row['floor_us']:.1f}",
            f"{row['expand_us']:.1f}" if row.get("expand_us") else "-",
            f"{row['write_us']:.1f}" if row.get("write_us") else "-",
        ]
        for name in names:
            us = row[name]["us"]
            cells.append(
                ("-" if us is None else f"{us:.2f}" if env.get("timer") == "graph" else f"{us:.1f}")
                + ("" if row[name]["exact"] else "*")
            )
        ours = row["ours"]["us"]
        cells += [f"{row[p]['us'] / ours:.3f}x" if row[p]["us"] and ours else "-" for p in peers]
        cells.append(f"{100 * row['floor_us'] / ours:.1f}%" if ours else "-")
        print("| " + " | ".join(cells) + " |")
    host = {n: v["host_us"] for n, v in rows[0].items() if isinstance(v, dict) and "host_us" in v}
    if host:
        print(
            f"\nhost time per call at {rows[0]['shape']} {rows[0]['dtype']} (us, no sync): "
            + ", ".join(f"{n} {v:.1f}" for n, v in host.items())
        )
    if harness:
        print("\nseed harness, 1000 x 9 weights, synchronize after each (seconds):")
        for name, seconds in harness.items():
            ratio = harness["bnb_ctypes"] / seconds if "bnb_ctypes" in harness else float("nan")
            print(f"  {name:16s} {seconds:7.3f}  ({ratio:.2f}x over bnb_ctypes)")


if __name__ == "__main__":
    main()
