"""torch.compile: a Linear4bit-style forward compiles to one graph for every layer (fullgraph, no recompiles), with
the kernel as one op call, bit for bit the eager result (GPU: Inductor needs a GPU target to trace the Triton
kernel); on the CPU, the exact CPU path as one opaque op, bit for bit the eager CPU path, and that filling the
kernel-table cache during a trace does not recompile the next layer."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import nf4convert

from fixtures.weights import OUT_DTYPES, bits, quantize

pytest.importorskip("bitsandbytes")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.gpu


def test_filling_the_table_cache_while_tracing_does_not_recompile(monkeypatch):
    import torch._dynamo

    from nf4convert import dequantize
    from nf4convert.formats import bnb4

    torch._dynamo.reset()
    monkeypatch.setattr(bnb4, "_code_cache", {})  # empty: the first trace fills it

    def scaled(x, quant_type):
        return x * dequantize._code_table(quant_type, x.device)[3]

    compiled = torch.compile(scaled, fullgraph=True, backend="aot_eager")
    generator = torch.Generator().manual_seed(5)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            x = torch.randn(17, generator=generator)
            assert torch.equal(compiled(x, "nf4"), x * bnb4.canonical_code("nf4")[3])
    assert bnb4._code_cache  # filled once, by the first call


def _layers(shape, count, dtype, nested, seed):
    return [
        quantize(shape, quant_type="nf4", blocksize=64, nested=nested, dtype=dtype, seed=seed + i, device=DEVICE)
        for i in range(count)
    ]


def _forward(x, packed, state):
    return x @ nf4convert.dequantize_4bit(packed, state).t()


@needs_cuda
@pytest.mark.parametrize("nested,dtype", [(True, torch.bfloat16), (False, torch.float16)])
def test_linear4bit_forward_one_graph_for_every_layer(nested, dtype):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    shape = (96, 200) if DEVICE == "cpu" else (1536, 1000)
    layers = _layers(shape, 3, dtype, nested, seed=11)
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.float32)
    counter = CompileCounterWithBackend("aot_eager" if DEVICE == "cpu" else "inductor")
    compiled = torch.compile(_forward, fullgraph=True, backend=counter)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for packed, state in layers:
            got = compiled(x.to(dtype), packed, state)
            want = _forward(x.to(dtype), packed, state)
            assert got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=2e-2, atol=1e-2)
    assert counter.frame_count == 1
    graph = counter.graphs[0]
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert any(t.split(".")[:2] == ["nf4convert", "dequantize_4bit"] for t in targets), targets  # not the CPU op


@needs_cuda
def test_compiled_weight_is_bit_exact():
    import torch._dynamo

    torch._dynamo.reset()
    shape = (77, 333) if DEVICE == "cpu" else (1024, 3072)
    compiled = torch.compile(
        lambda packed, state: nf4convert.dequantize_4bit(packed, state) * 2,
        fullgraph=True,
        backend="aot_eager" if DEVICE == "cpu" else "inductor",
    )
    with torch._dynamo.config.patch(error_on_recompile=True):
        for packed, state in _layers(shape, 2, torch.bfloat16, True, seed=21):
            # Doubling is exact: the compiled bits are the eager bits, doubled.
            assert torch.equal(bits(compiled(packed, state)), bits(nf4convert.dequantize_4bit(packed, state) * 2))


def _cpu_op_calls(counter):
    targets = [str(node.target) for graph in counter.graphs for node in graph.graph.nodes if node.op == "call_function"]
    return [target for target in targets if target.split(".")[:2] == ["nf4convert", "dequantize_4bit_cpu"]]


@pytest.mark.parametrize("dtype", OUT_DTYPES)
@pytest.mark.parametrize("quant_type,nested", [("nf4", True), ("nf4", False), ("fp4", True), ("fp4", False)])
def test_cpu_tensors_compile_to_the_exact_cpu_path(quant_type, nested, dtype):
    """Inductor, fullgraph, CPU tensors: one opaque op per call (traced, Inductor would contract the multiplies and adds
    into FMAs), bit for bit the eager CPU path, one graph for two weights of one shape, with and without ``out``."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    shape = (37, 91)  # odd: a partial last block and a last byte of one element
    weights = [
        quantize(shape, quant_type=quant_type, blocksize=64, nested=nested, dtype=dtype, seed=seed) for seed in (41, 42)
    ]
    counter = CompileCounterWithBackend("inductor")

    def on_cpu(packed, state):
        return nf4convert.dequantize_4bit(packed, state, backend="cpu")

    def by_device(packed, state):
        return nf4convert.dequantize_4bit(packed, state)  # backend="auto"

    def into(packed, state, out):
        return nf4convert.dequantize_4bit(packed, state, out=out)

    fresh = [torch.compile(function, fullgraph=True, backend=counter) for function in (on_cpu, by_device)]
    into_compiled = torch.compile(into, fullgraph=True, backend=counter)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for packed, state in weights:
            want = bits(nf4convert.dequantize_4bit(packed, state, backend="cpu"))
            for compiled in fresh:
                got = compiled(packed, state)
                assert got.shape == shape and got.dtype == dtype and torch.equal(bits(got), want)
            out = torch.full((shape[0] * shape[1],), float("nan"), dtype=dtype)
            got = into_compiled(packed, state, out)
            assert got.shape == shape and got.data_ptr() == out.data_ptr() and torch.equal(bits(out), want)
    assert counter.frame_count == 3  # one graph each, none again for the second weight
    assert len(_cpu_op_calls(counter)) == 3


def test_cpu_op_inside_a_fused_graph_keeps_its_bits():
    """Inductor fuses the arithmetic around the op into a kernel of its own, never into the op: three layers, one graph,
    the op once in it, the eager bits (doubled: exact)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    layers = [
        quantize((96, 200), quant_type="fp4", blocksize=128, nested=True, dtype=torch.bfloat16, seed=51 + i)
        for i in range(3)
    ]
    counter = CompileCounterWithBackend("inductor")

    def doubled(packed, state):
        return nf4convert.dequantize_4bit(packed, state) * 2

    compiled = torch.compile(doubled, fullgraph=True, backend=counter)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for packed, state in layers:
            assert torch.equal(bits(compiled(packed, state)), bits(doubled(packed, state)))
    assert counter.frame_count == 1 and len(_cpu_op_calls(counter)) == 1


@pytest.mark.parametrize("case", ["triton-on-cpu", "cpu-on-meta", "offset-none"])
def test_argument_errors_are_checked_under_compile(case, monkeypatch):
    """The eager rules hold in a trace: where Dynamo falls back (no fullgraph) the very ArgumentError comes out; under
    fullgraph Dynamo refuses the raise at trace time (it lets no exception out of a compiled region), before any op."""
    import torch._dynamo

    from nf4convert import ArgumentError

    packed, state = quantize((24, 70), quant_type="nf4", blocksize=64, nested=True, dtype=torch.float16, seed=61)
    backend, message = {
        "triton-on-cpu": ("triton", r"^backend='triton' needs CUDA tensors"),
        "cpu-on-meta": ("cpu", r"^backend='cpu' needs CPU tensors, not meta tensors$"),  # as it is for CUDA tensors
        "offset-none": ("auto", r"^quant_state.offset is None; a nested quant state needs its offset$"),
    }[case]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if case == "cpu-on-meta":
        packed, state.absmax, state.offset = packed.to("meta"), state.absmax.to("meta"), state.offset.to("meta")
        state.state2.absmax, state.state2.code = state.state2.absmax.to("meta"), state.state2.code.to("meta")
    if case == "offset-none":
        state.offset = None

    def dequantize(packed):
        return nf4convert.dequantize_4bit(packed, state, backend=backend)

    with pytest.raises(ArgumentError, match=message):
        dequantize(packed)
    torch._dynamo.reset()
    with pytest.raises(ArgumentError, match=message):
        torch.compile(dequantize, backend="aot_eager")(packed)
    torch._dynamo.reset()
    with pytest.raises((ArgumentError, torch._dynamo.exc.Unsupported)):
        torch.compile(dequantize, fullgraph=True, backend="aot_eager")(packed)


def test_malformed_quant_states_are_argument_errors_under_compile():
    """The quant-state checks trace (no tensor data read): each malformed state is the eager ArgumentError, not an
    error of Dynamo's, where Dynamo falls back to eager at the refusal."""
    import torch._dynamo
    from test_dequantize_cpu import MALFORMED, _state

    from nf4convert import ArgumentError

    for case, (broken, message) in MALFORMED.items():
        packed, state = _state()
        state = broken(state)
        torch._dynamo.reset()
        with pytest.raises(ArgumentError, match=f"^{message}$"):
            torch.compile(lambda packed, state: nf4convert.dequantize_4bit(packed, state), backend="aot_eager")(
                packed, state
            )


def test_a_refused_call_leaves_the_compiled_function_working():
    """Once a refusal fell back to eager (a graph break), Dynamo compiled the argument checks as a function of their
    own and rebuilt its returned table by its global name, which is the table's function: every later valid call
    failed ("Expected a value of type 'Tensor' for argument 'code' but instead found type 'function'")."""
    import copy

    import torch._dynamo

    from nf4convert import ArgumentError

    packed, state = quantize((64, 128), quant_type="nf4", blocksize=64, nested=True, dtype=torch.bfloat16, seed=4)
    want = nf4convert.dequantize_4bit(packed, state)
    broken = copy.copy(state)
    broken.blocksize = 63
    torch._dynamo.reset()
    compiled = torch.compile(lambda packed, state: nf4convert.dequantize_4bit(packed, state))  # torch's defaults
    with pytest.raises(ArgumentError, match="blocksize"):
        compiled(packed, broken)
    for _ in range(2):
        assert torch.equal(bits(compiled(packed, state)), bits(want))


@needs_cuda
def test_cpu_backend_with_cuda_tensors_is_refused_under_compile():
    import torch._dynamo

    from nf4convert import ArgumentError

    packed, state = _layers((64, 96), 1, torch.bfloat16, True, seed=71)[0]
    torch._dynamo.reset()
    with pytest.raises(ArgumentError, match=r"^backend='cpu' needs CPU tensors, not cuda tensors$"):
        torch.compile(lambda p: nf4convert.dequantize_4bit(p, state, backend="cpu"))(packed)


def test_eager_cpu_calls_do_not_import_the_compiler():
    """The CPU path's compile op lives with the Triton one, imported by a trace only: importing nf4convert and
    dequantizing CPU tensors eagerly (every backend that runs there) import neither Dynamo nor Inductor."""
    import subprocess
    import sys

    code = """
import sys, torch, nf4convert
from nf4convert.formats.bnb4 import NestedState
generator = torch.Generator().manual_seed(7)
packed = torch.randint(0, 256, (2000,), dtype=torch.uint8, generator=generator)
flat = nf4convert.QuantState4bit(absmax=torch.rand(63, generator=generator), shape=torch.Size([40, 100]),
                                 dtype=torch.bfloat16, blocksize=64, quant_type="nf4")
nested = nf4convert.QuantState4bit(absmax=torch.randint(0, 256, (63,), dtype=torch.uint8, generator=generator),
                                   shape=torch.Size([40, 100]), dtype=torch.float16, blocksize=64, quant_type="fp4",
                                   offset=torch.tensor(0.01), state2=NestedState(torch.rand(1, generator=generator),
                                   torch.linspace(-1, 1, 256), 256))
for state in (flat, nested):
    for backend in ("auto", "cpu"):
        assert nf4convert.dequantize_4bit(packed, state, backend=backend).isfinite().all()
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the launcher needs Triton")
def test_eager_launches_do_not_import_the_compiler():
    """Registering the compile op imports torch._dynamo and Inductor (seconds): only a trace may pay that."""
    import subprocess
    import sys

    code = (
        "import sys, torch, nf4convert.dequantize, nf4convert.kernels.launch; "
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


# docs/performance.md's settings for a compiled model of many layers: torch's filter that drops Dynamo's guards on
# module state (the quant states included), with CUDA graphs, or without them Inductor's size asserts off (they repeat
# what Dynamo's guards check) and our kernel launched by torch's own launcher. Guards and asserts run before a forward's
# first kernel.
FOR_MODELS = {
    "cuda-graphs": {"triton.cudagraphs": True},
    "plain": {"size_asserts": False, "static_launch_user_defined_triton_kernels": True},
}


@needs_cuda
@pytest.mark.parametrize("settings", FOR_MODELS)
def test_module_stack_with_readmes_settings_for_models_is_bit_exact(settings):
    import torch._dynamo
    import torch._inductor.config

    missing = [key for key in FOR_MODELS[settings] if not hasattr(torch._inductor.config, key)]
    if missing:
        pytest.skip(f"this torch's Inductor has no {missing[0]}")
    torch._dynamo.reset()

    class Layer(torch.nn.Module):
        def __init__(self, packed, state):
            super().__init__()
            self.weight = torch.nn.Parameter(packed, requires_grad=False)
            self.quant_state = state

        def forward(self, x):
            return nf4convert.dequantize_4bit(self.weight, self.quant_state) * x

    class Stack(torch.nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer(p, s) for p, s in layers)

        def forward(self, x):
            return tuple(layer(x) for layer in self.layers)

    stack = Stack(_layers((1536, 1000), 3, torch.bfloat16, True, seed=31))
    options = {**FOR_MODELS[settings], "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    compiled = torch.compile(stack, fullgraph=True, options=options)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for scale in (1.0, 2.0, 4.0, 0.5):  # warm-up, recording, replays; scaling by a power of two is exact
            x = torch.full((1,), scale, dtype=torch.bfloat16, device=DEVICE)
            got = [out.clone() for out in compiled(x)]
            want = [nf4convert.dequantize_4bit(layer.weight, layer.quant_state) * x for layer in stack.layers]
            assert all(torch.equal(bits(g), bits(w)) for g, w in zip(got, want))
