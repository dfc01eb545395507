"""torch.compile: a Linear4bit-style forward compiles to one graph for every layer (fullgraph, no recompiles), with
the kernel as one op call, bit for bit the eager result (GPU: Inductor needs a GPU target to trace the Triton
kernel); on the CPU, that filling the kernel-table cache during a trace does not recompile the next layer."""

from __future__ import annotations

import pytest
import torch

import nf4convert
from helpers import bits, quantize

pytest.importorskip("bitsandbytes")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


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
    return [quantize(shape, quant_type="nf4", blocksize=64, nested=nested, dtype=dtype, seed=seed + i, device=DEVICE)
            for i in range(count)]  # fmt: skip


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
    assert any("nf4convert.dequantize_4bit" in t for t in targets), targets


@needs_cuda
def test_compiled_weight_is_bit_exact():
    import torch._dynamo

    torch._dynamo.reset()
    shape = (77, 333) if DEVICE == "cpu" else (1024, 3072)
    compiled = torch.compile(lambda packed, state: nf4convert.dequantize_4bit(packed, state) * 2, fullgraph=True,
                             backend="aot_eager" if DEVICE == "cpu" else "inductor")  # fmt: skip
    with torch._dynamo.config.patch(error_on_recompile=True):
        for packed, state in _layers(shape, 2, torch.bfloat16, True, seed=21):
            # Doubling is exact: the compiled bits are the eager bits, doubled.
            assert torch.equal(bits(compiled(packed, state)), bits(nf4convert.dequantize_4bit(packed, state) * 2))


def test_eager_launches_do_not_import_the_compiler():
    """Registering the compile op imports torch._dynamo and Inductor (seconds): only a trace may pay that."""
    import subprocess
    import sys

    code = ("import sys, torch, nf4convert.dequantize, nf4convert.kernels.launch; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


# README's settings for a compiled model of many layers: torch's filter that drops Dynamo's guards on module state
# (the quant states included), with CUDA graphs, or without them Inductor's size asserts off (they repeat what Dynamo's
# guards check) and our kernel launched by torch's own launcher. Guards and asserts run before a forward's first kernel.
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
