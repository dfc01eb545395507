"""torch.compile against eager, weight shape by weight shape: the op alone, and Linear4bit-style layers.

    python benchmarks/bench_compile.py [--layers 16,48] [--shapes 1024x1024,...] [--json FILE]
        [--guards skip-nn-modules] [--inductor size_asserts=0 ...] [--host-only]

Weights: bitsandbytes-quantized NF4, double quantization, blocksize 64, in fp16 and bf16. For each shape:

  op       one ``dequantize_4bit(packed, state)``: eager, and compiled (fullgraph, static shapes, compiled
           afresh for the shape). do_bench median (L2 flushed before each call), and host us per call.
  layers   N Linear4bit-style modules (weight = the packed Params4bit data, ``quant_state`` beside it,
           ``forward(x) = F.linear(x, dequantize_4bit(weight, quant_state))``, x one token), called in turn by
           one forward: eager, and ``torch.compile(model, fullgraph=True)``. Seconds per forward until the GPU is
           done (synchronized), median of 90, eager and compiled timed in alternating rounds, for each N of
           --layers. The table splits a forward's time in two: per layer, the slope between the smallest and the
           largest stack (what one more layer costs, as in a model of many), and fixed, what remains (what a
           forward pays once: Dynamo's guards and wrappers, the first launch, the synchronize). The compiled
           forward must be one graph: the graphs Inductor compiled are counted, and every call runs with
           ``error_on_recompile``.
  weights  the same layers' forward returning the dequantized weights only (no matmul): the op's own cost.
  dense    the control: the same stack with plain dense weights (F.linear only, the dequantized weights as
           parameters): what torch.compile costs or saves on a forward with none of our op in it.
  *_graphs the same two compiled with CUDA graphs (Inductor's triton.cudagraphs, what mode="reduce-overhead" sets).
           Dynamo marks tensors reached through a module static (the quant state's too), so replays copy none of them.

Compiled weights are checked bit for bit against eager (the layers' outputs only for closeness: Inductor may pick
another matmul). Then, on the first shape, where a compiled op call's host time goes: the call with Dynamo's guards
filtered out (what the guards cost), a compiled function that returns its input, a cProfile of compiled calls, and
bench_dequant's seed harness eager and compiled. --guards and --inductor settings apply to every compile of the run
(README's settings for compiled models: --guards skip-nn-modules --inductor size_asserts=0
--inductor static_launch_user_defined_triton_kernels=1).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import json
import pstats
import statistics
import time

import torch
import triton
from triton.testing import do_bench

import nf4convert

# --guards: Dynamo's own guards, or a torch.compiler guard filter (by name) for every compiled stack.
GUARD_FILTERS = {"all": None, "skip-nn-modules": "skip_guard_on_all_nn_modules_unsafe"}
SHAPES = [(1024, 1024), (4096, 1024), (4096, 4096), (14336, 4096), (28672, 8192)]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Inductor settings that change how a compiled call launches our kernel: printed with every run.
INDUCTOR_KEYS = ("use_static_cuda_launcher", "static_launch_user_defined_triton_kernels", "cpp_wrapper")


class Layer(torch.nn.Module):
    """What bitsandbytes' Linear4bit holds (packed weight, quant state) with our dequantize in its forward."""

    def __init__(self, packed, state):
        super().__init__()
        self.weight = torch.nn.Parameter(packed, requires_grad=False)
        self.quant_state = state

    def forward(self, x):
        return torch.nn.functional.linear(x, nf4convert.dequantize_4bit(self.weight, self.quant_state))


class Dense(torch.nn.Module):
    def __init__(self, weights):
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(w, requires_grad=False) for w in weights)

    def forward(self, x):
        return tuple(torch.nn.functional.linear(x, w) for w in self.weights)


class Layers(torch.nn.Module):
    def __init__(self, layers, weights_only=False):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.weights_only = weights_only

    def forward(self, x):
        if self.weights_only:
            return tuple(nf4convert.dequantize_4bit(layer.weight, layer.quant_state) for layer in self.layers)
        return tuple(layer(x) for layer in self.layers)


def quantized(shape, dtype, seed):
    import bitsandbytes.functional as F

    generator = torch.Generator("cuda").manual_seed(seed)
    weight = torch.randn(shape, dtype=dtype, device="cuda", generator=generator) * 0.02
    return F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)


def paired_seconds(first, second, rounds=6, reps=15):
    """Median seconds per synchronized call of each of two functions, timed in alternating rounds (with the garbage
    collector off) so that a noisy stretch of the host hits both alike."""
    times = ([], [])
    for fn in (first, second):
        fn()
    torch.cuda.synchronize()
    gc.collect()
    gc.disable()
    try:
        for round_ in range(rounds):
            for index in (0, 1) if round_ % 2 == 0 else (1, 0):
                fn = (first, second)[index]
                for _ in range(reps):
                    started = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    times[index].append(time.perf_counter() - started)
    finally:
        gc.enable()
    return statistics.median(times[0]), statistics.median(times[1])


def fresh():
    """Forget every compiled graph, and the CUDA graph trees (torch 2.13's Dynamo reset drops them too; with only
    that reset, on torch 2.11 with this benchmark's backend, 16 weights of 14336x4096 under CUDA graphs ran 60.8 us
    per layer recorded after the earlier stacks, 45.7 alone)."""
    torch._dynamo.reset()
    if torch.cuda.is_available():
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        reset_cudagraph_trees()
    gc.collect()


def stack_times(make_model, weights, counts, x, mode, check, options=None):
    """Synchronized forward times of ``make_model(weights[:n])`` eager and compiled (in ``mode``, with ``options``),
    for each n in ``counts``: per layer, the slope between the smallest and largest n (what each more layer costs);
    fixed, what a forward costs beyond its layers (the intercept: Dynamo's guards, the wrappers, the first launch,
    the sync)."""
    forwards, exact, graphs = {}, True, 0
    for n in counts:
        fresh()
        model = make_model(weights[:n])
        compiled, counter = compile_counted(model, mode=mode, options=options)
        with torch._dynamo.config.patch(error_on_recompile=True):
            exact = exact and check(compiled(x), model(x))
            forwards[n] = [seconds * 1e6 for seconds in paired_seconds(lambda: model(x), lambda: compiled(x))]
        graphs = max(graphs, counter.frame_count)
        model = compiled = None  # free this stack before the next is built
    fresh()
    low, high = min(counts), max(counts)
    result = {"exact": exact, "graphs": graphs, "forward_us": {str(n): forwards[n] for n in counts}}
    for index, name in enumerate(("eager", "compiled")):
        per_layer = (
            (forwards[high][index] - forwards[low][index]) / (high - low) if high > low else forwards[low][index] / low
        )
        result[f"{name}_us_per_layer"] = per_layer
        result[f"{name}_fixed_us"] = forwards[low][index] - low * per_layer
    return result


def host_us(fn, calls=2000):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def same_bits(a, b):
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))


def close(a, b):
    return all(torch.allclose(x.float(), y.float(), rtol=1e-2, atol=1e-3) for x, y in zip(a, b))


class _Counted:
    """The graphs Dynamo handed to Inductor (in any mode): more than one for a layer stack means a recompile."""

    def __init__(self):
        self.frame_count = 0

    def __call__(self, graph, example_inputs, mode=None, options=None):
        from torch._inductor.compile_fx import compile_fx

        self.frame_count += 1
        return compile_fx(graph, example_inputs, config_patches=options)


def compile_counted(module_or_fn, mode=None, options=None):
    """torch.compile(fullgraph, static shapes) with Inductor, in ``mode`` (None, or reduce-overhead: CUDA graphs)."""
    counter = _Counted()
    patches = dict(options or {})
    if mode == "reduce-overhead":
        patches["triton.cudagraphs"] = True
    guard_filter = patches.pop("guard_filter_fn", None)

    def backend(graph, example_inputs):
        return counter(graph, example_inputs, options=patches)

    extra = {"options": {"guard_filter_fn": guard_filter}} if guard_filter else {}
    return torch.compile(module_or_fn, fullgraph=True, dynamic=False, backend=backend, **extra), counter


def list_kernels(shape, dtype=torch.float16, weights_only=True, mode=None, layers=4):
    """What a compiled weights (or layers) forward runs on the GPU beside eager's, kernel by kernel (``mode``
    reduce-overhead: the compiled forward with CUDA graphs), after both forwards' synchronized times."""
    from torch.profiler import ProfilerActivity, profile

    model = Layers([Layer(*quantized(shape, dtype, seed)) for seed in range(layers)], weights_only=weights_only)
    compiled, _ = compile_counted(model, mode=mode)
    x = torch.randn(1, shape[1], dtype=dtype, device="cuda")
    for _ in range(3):
        model(x), compiled(x)
    torch.cuda.synchronize()
    eager_s, compiled_s = paired_seconds(lambda: model(x), lambda: compiled(x))
    print(
        f"===== {layers} layers, mode {mode}: per layer of a synchronized forward, eager "
        f"{eager_s / layers * 1e6:.1f} us, "
        f"compiled {compiled_s / layers * 1e6:.1f} us"
    )
    for name, forward in (("eager", model), ("compiled", compiled)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            for _ in range(5):
                forward(x)
            torch.cuda.synchronize()
        print(f"===== {name}: 5 forwards of {layers} weights")
        print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    for name, forward in (("eager", model), ("compiled", compiled)):
        print(
            f"===== {name}: host time of a {layers}-weight forward, {host_us(lambda: forward(x), calls=500):.1f} us; "
            "cProfile:"
        )
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(500):
            forward(x)
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def host_diagnostics(shape, harness_iterations, inductor):
    """Where a compiled op call's host time goes, on one shape (Dynamo's guards dropped, a compiled function that
    returns its input, a cProfile), and bench_dequant's seed harness (9 weights, each called and synchronized
    alone) eager and compiled."""
    from bench_dequant import HARNESS  # noqa: PLC0415  (benchmarks/ is the script's folder)

    fresh()
    packed, state = quantized(shape, torch.float16, 0)
    diagnostics = {"eager_host_us": host_us(lambda: nf4convert.dequantize_4bit(packed, state))}
    compiled_op, _ = compile_counted(lambda p, s: nf4convert.dequantize_4bit(p, s), options=inductor)
    diagnostics["compiled_host_us"] = host_us(lambda: compiled_op(packed, state))
    try:
        fresh()
        unguarded, _ = compile_counted(
            lambda p, s: nf4convert.dequantize_4bit(p, s),
            options={**inductor, "guard_filter_fn": lambda entries: [False] * len(entries)},
        )
        diagnostics["compiled_no_guards_host_us"] = host_us(lambda: unguarded(packed, state))
    except Exception as error:  # noqa: BLE001  (a torch without guard_filter_fn: reported)
        diagnostics["compiled_no_guards_host_us"] = f"{type(error).__name__}: {error}"[:200]
    identity = torch.compile(lambda p, s: p, fullgraph=True, dynamic=False)
    diagnostics["compiled_identity_host_us"] = host_us(lambda: identity(packed, state))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(2000):
        compiled_op(packed, state)
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
    diagnostics["profile"] = text.getvalue()[-3500:]
    if harness_iterations:
        fresh()
        weights = [
            quantized(s, dtype, seed)
            for seed, (_, _, hidden, intermediate, dtype) in enumerate(HARNESS)
            for s in ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate))
        ]
        compiled_op, _ = compile_counted(lambda p, s: nf4convert.dequantize_4bit(p, s), options=inductor)
        harness = {}
        with torch._dynamo.config.patch(recompile_limit=64):  # one graph per weight shape
            for name, fn in (("eager", nf4convert.dequantize_4bit), ("compiled", compiled_op)):
                for packed, state in weights:
                    fn(packed, state)
                torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(harness_iterations):
                    for packed, state in weights:
                        fn(packed, state)
                        torch.cuda.synchronize()
                harness[name] = time.perf_counter() - started
        diagnostics["harness_seconds"] = harness
    print(json.dumps({k: v for k, v in diagnostics.items() if k != "profile"}), flush=True)
    print(diagnostics["profile"], flush=True)
    return diagnostics


def main():
    import bitsandbytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--layers",
        default="16,48",
        help="layer counts of the stacks, comma-separated: the per-layer "
        "cost is the slope between the smallest and largest, the fixed cost per forward what remains",
    )
    parser.add_argument("--shapes", help="e.g. 1024x1024,28672x8192 (default: all)")
    parser.add_argument("--dtypes", help="e.g. fp16 (default: fp16,bf16)")
    parser.add_argument(
        "--guards",
        choices=GUARD_FILTERS,
        default="all",
        help="compile the stacks with Dynamo's guards "
        "(all), or without those on module state, the quant states' included (torch's "
        "skip_guard_on_all_nn_modules_unsafe: what the guards cost per layer)",
    )
    parser.add_argument("--json")
    parser.add_argument("--table", help="print the table of an earlier --json file and stop")
    parser.add_argument(
        "--kernels",
        metavar="SHAPE",
        help="only list the GPU kernels (torch.profiler) of an eager and a "
        "compiled 4-layer weights forward of SHAPE, e.g. 14336x4096 (with TORCH_LOGS=output_code: the code)",
    )
    parser.add_argument("--kernels-dtype", choices=DTYPES, default="fp16")
    parser.add_argument("--kernels-forward", choices=("weights", "layers"), default="weights")
    parser.add_argument(
        "--kernels-mode",
        choices=("default", "reduce-overhead"),
        default="default",
        help="compile the listed forward plainly or with CUDA graphs",
    )
    parser.add_argument("--kernels-layers", type=int, default=4)
    parser.add_argument(
        "--host-only",
        action="store_true",
        help="only where a compiled call's host time goes and the seed harness, on the first of --shapes",
    )
    parser.add_argument("--harness-iterations", type=int, default=1000, help="rounds of the seed harness (0: none)")
    parser.add_argument(
        "--inductor",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an Inductor option for "
        "every compile of this run, as torch.compile(options=...) gives it, e.g. size_asserts=0 (repeatable)",
    )
    options = parser.parse_args()
    import torch._inductor.config  # noqa: PLC0415

    inductor = {}  # --inductor: passed as torch.compile(options=...) would pass them
    for setting in options.inductor:
        key, _, value = setting.partition("=")
        if not hasattr(torch._inductor.config, key):
            parser.error(f"--inductor {setting}: this torch's Inductor has no setting {key!r}")
        inductor[key] = {"1": True, "true": True, "0": False, "false": False}.get(value.lower(), value)
    if options.table:
        saved = json.load(open(options.table))
        return print_table(saved["env"], saved["rows"])
    if options.kernels:
        return list_kernels(
            tuple(int(n) for n in options.kernels.split("x")),
            DTYPES[options.kernels_dtype],
            options.kernels_forward == "weights",
            None if options.kernels_mode == "default" else options.kernels_mode,
            options.kernels_layers,
        )
    shapes = [tuple(int(n) for n in s.split("x")) for s in options.shapes.split(",")] if options.shapes else SHAPES
    guard_filter = GUARD_FILTERS[options.guards]
    stack_options = {**inductor, **({"guard_filter_fn": getattr(torch.compiler, guard_filter)} if guard_filter else {})}
    counts = sorted({int(n) for n in options.layers.split(",")})
    dtypes = {name: DTYPES[name] for name in options.dtypes.split(",")} if options.dtypes else DTYPES
    env = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "date": datetime.date.today().isoformat(),
        "layers": counts,
        "guards": options.guards,
        "inductor": {key: inductor.get(key, getattr(torch._inductor.config, key, None)) for key in INDUCTOR_KEYS},
    }
    print(" ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    rows = []
    for shape in [] if options.host_only else shapes:
        for dtype_name, dtype in dtypes.items():
            fresh()
            weights = [quantized(shape, dtype, seed) for seed in range(max(counts))]
            packed, state = weights[0]
            row = {"shape": f"{shape[0]}x{shape[1]}", "dtype": dtype_name}

            def eager_op():
                return nf4convert.dequantize_4bit(packed, state)

            compiled_op, counter = compile_counted(lambda p, s: nf4convert.dequantize_4bit(p, s), options=inductor)
            compiled_op(packed, state)
            row["op"] = {
                "exact": same_bits([compiled_op(packed, state)], [eager_op()]),
                "eager_us": do_bench(eager_op, warmup=25, rep=100, return_mode="median") * 1e3,
                "compiled_us": do_bench(lambda: compiled_op(packed, state), warmup=25, rep=100, return_mode="median")
                * 1e3,
                "eager_host_us": host_us(eager_op),
                "compiled_host_us": host_us(lambda: compiled_op(packed, state)),
            }
            x = torch.randn(1, shape[1], dtype=dtype, device="cuda")
            for kind, weights_only, mode in (
                ("layers", False, None),
                ("weights", True, None),
                ("layers_graphs", False, "reduce-overhead"),
                ("weights_graphs", True, "reduce-overhead"),
            ):
                row[kind] = stack_times(
                    lambda ws, w=weights_only: Layers([Layer(p, s) for p, s in ws], weights_only=w),
                    weights,
                    counts,
                    x,
                    mode,
                    close if kind.startswith("layers") else same_bits,
                    stack_options,
                )
            dense_weights = [nf4convert.dequantize_4bit(p, s) for p, s in weights]
            row["dense"] = stack_times(Dense, dense_weights, counts, x, None, close, stack_options)
            rows.append(row)
            print(json.dumps(row), flush=True)
            weights = packed = state = dense_weights = None  # free this shape's tensors

    diagnostics = host_diagnostics(shapes[0], options.harness_iterations, inductor)

    if options.json:
        with open(options.json, "w") as file:
            json.dump({"env": env, "rows": rows, "diagnostics": diagnostics}, file, indent=1)
    if rows:
        print_table(env, rows)


def print_table(env, rows):
    counts = env["layers"] if isinstance(env["layers"], list) else [env["layers"]]
    print(
        f"\n{env['gpu']}, torch {env['torch']}, Triton {env['triton']}, {env['date']}; stacks of {counts} layers; us. "
        "op: do_bench median / host per call. layers, weights, dense: per layer (the slope between the stacks), "
        f"fixed: per forward beyond its layers, eager/compiled; forward x: a {counts[-1]}-layer forward, compiled "
        "over eager "
        "(layers/weights/dense)"
    )
    header = [
        "shape",
        "dtype",
        "op eager",
        "op compiled",
        "op host eager",
        "op host compiled",
        "layers eager",
        "layers compiled",
        "x",
        "weights eager",
        "weights compiled",
        "x",
        "dense eager",
        "dense compiled",
        "x",
        "fixed layers",
        "fixed weights",
        "forward x",
        "graphs",
        "exact",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        for suffix in ("", "_graphs"):
            print("| " + " | ".join(_cells(row, suffix, counts[-1])) + " |")


def _cells(row, suffix, count):
    op, layers, weights = row["op"], row["layers" + suffix], row["weights" + suffix]
    dense = None if suffix else row.get("dense")  # the control is compiled without CUDA graphs only
    cells = [row["shape"] + suffix, row["dtype"]] + [
        f"{op[k]:.1f}" for k in ("eager_us", "compiled_us", "eager_host_us", "compiled_host_us")
    ]
    for stack in (layers, weights, dense):
        if stack is None:
            cells += ["-"] * 3
            continue
        eager, compiled = stack["eager_us_per_layer"], stack["compiled_us_per_layer"]
        cells += [f"{eager:.1f}", f"{compiled:.1f}", f"{compiled / eager:.2f}"]
    for stack in (layers, weights):
        cells.append(
            f"{stack['eager_fixed_us']:.0f}/{stack['compiled_fixed_us']:.0f}" if "eager_fixed_us" in stack else "-"
        )
    ratios = [
        f"{s['forward_us'][str(count)][1] / s['forward_us'][str(count)][0]:.2f}" if s and "forward_us" in s else "-"
        for s in (layers, weights, dense)
    ]
    cells.append("/".join(ratios))
    cells.append(f"{layers['graphs']}/{weights['graphs']}")
    cells.append(str(op["exact"] and layers["exact"] and weights["exact"] and (dense or {}).get("exact", True)))
    return cells


if __name__ == "__main__":
    main()
