"""GPU tests: the kernel against bitsandbytes' CUDA kernels, bit for bit (skipped without CUDA).

Run on a GPU machine with bitsandbytes installed: ``pytest tests/test_dequantize_gpu.py``.
"""

import random

import pytest
import torch

import nf4convert

from fixtures.weights import STORAGE_DTYPES, bits, quantize

pytestmark = pytest.mark.gpu
F = pytest.importorskip("bitsandbytes.functional") if torch.cuda.is_available() else None

_rng = random.Random(20261124)  # fixed: the same cases (and test ids) every run
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _assert_same(got, expected):
    assert got.shape == expected.shape and got.dtype == expected.dtype
    mismatches = (bits(got) != bits(expected)).sum().item()
    assert mismatches == 0, f"{mismatches} of {got.numel()} elements differ from bitsandbytes"


def _grid(count):
    cases = []
    for index in range(count):
        rows = _rng.choice((1, 3, _rng.randint(1, 300)))
        cols = _rng.choice((1, 7, _rng.randint(1, 5000)))
        seed = _rng.randrange(1 << 30)
        cases.append(
            pytest.param(
                (rows, cols),
                BLOCKSIZES[index % 8],
                ("nf4", "fp4")[index % 2],
                bool((index // 2) % 2),
                DTYPES[index % 3],
                seed,
                id=f"case{index}-seed{seed}",
            )
        )
    return cases


@pytest.mark.parametrize("shape,blocksize,quant_type,nested,dtype,seed", _grid(96))
def test_bit_exact_with_bnb_cuda(shape, blocksize, quant_type, nested, dtype, seed):
    packed, state = quantize(
        shape, quant_type=quant_type, blocksize=blocksize, nested=nested, dtype=dtype, device="cuda", seed=seed
    )
    _assert_same(nf4convert.dequantize_4bit(packed, state), F.dequantize_4bit(packed, state))


@pytest.mark.parametrize("storage", STORAGE_DTYPES)
def test_storage_dtypes(storage):
    shape = (2 * _rng.randint(1, 200), 4 * _rng.randint(1, 500))
    for quant_type in ("nf4", "fp4"):
        packed, state = quantize(
            shape,
            quant_type=quant_type,
            blocksize=64,
            nested=True,
            dtype=torch.bfloat16,
            storage=storage,
            device="cuda",
        )
        _assert_same(nf4convert.dequantize_4bit(packed, state), F.dequantize_4bit(packed, state))


@pytest.mark.parametrize("shape", [(28672, 8192), (14336, 4096), (4096, 14336), (8192, 2048)])
def test_large_shapes(shape):
    for quant_type, dtype, nested in (("nf4", torch.bfloat16, True), ("fp4", torch.float16, False)):
        packed, state = quantize(shape, quant_type=quant_type, blocksize=64, nested=nested, dtype=dtype, device="cuda")
        _assert_same(nf4convert.dequantize_4bit(packed, state), F.dequantize_4bit(packed, state))
        del packed, state
        torch.cuda.empty_cache()


def test_tiny_scales_subnormal_products():
    # Scales near the bottom of fp32 give subnormal products: flushing or not must match bitsandbytes.
    for dtype in DTYPES:
        for quant_type in ("nf4", "fp4"):
            packed, state = quantize(
                (64, 256), quant_type=quant_type, blocksize=64, nested=False, dtype=torch.float32, device="cuda"
            )
            state.absmax = state.absmax * 1e-37
            state.dtype = dtype
            _assert_same(nf4convert.dequantize_4bit(packed, state), F.dequantize_4bit(packed, state))


def test_no_memory_beyond_the_output():
    packed, state = quantize(
        (8192, 4096), quant_type="nf4", blocksize=64, nested=True, dtype=torch.bfloat16, device="cuda"
    )
    nf4convert.dequantize_4bit(packed, state)  # compile and cache outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = nf4convert.dequantize_4bit(packed, state)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before == out.numel() * out.element_size()
    preallocated = torch.empty_like(out)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    nf4convert.dequantize_4bit(packed, state, out=preallocated)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == before


def test_torch_compile_fullgraph_bit_exact_without_recompiles():
    import torch._dynamo

    torch._dynamo.reset()
    layers = [
        quantize((1024, 3072), quant_type="nf4", blocksize=64, nested=True, dtype=torch.bfloat16, device="cuda")
        for _ in range(3)
    ]

    @torch.compile(fullgraph=True)
    def dequantize_and_scale(packed, state):
        return nf4convert.dequantize_4bit(packed, state) * 2

    with torch._dynamo.config.patch(error_on_recompile=True):
        for packed, state in layers:
            got = dequantize_and_scale(packed, state)
            # Doubling is exact, so the compiled kernel's bits must be bitsandbytes' bits, doubled.
            _assert_same(got, F.dequantize_4bit(packed, state) * 2)


@pytest.mark.parametrize(
    "quant_type,nested,dtype",
    [("fp4", False, torch.float16), ("nf4", True, torch.float32), ("fp4", True, torch.bfloat16)],
)
def test_torch_compile_other_states(quant_type, nested, dtype):
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(lambda packed, state: nf4convert.dequantize_4bit(packed, state), fullgraph=True)
    packed, state = quantize(
        (333, 777), quant_type=quant_type, blocksize=128, nested=nested, dtype=dtype, device="cuda"
    )
    _assert_same(compiled(packed, state), F.dequantize_4bit(packed, state))


@pytest.mark.parametrize(
    "batch,seq,hidden,intermediate,dtype",
    [
        (2, 3333, 2048, 8192, torch.float16),
        (5, 777, 1024, 4096, torch.bfloat16),
        (3, 2048, 4096, 14336, torch.bfloat16),
    ],
)
def test_mlp_harness(batch, seq, hidden, intermediate, dtype):
    # The seed's harness: an MLP of three double-quantized NF4 Linear4bit layers (gate, up, down).
    import bitsandbytes as bnb

    def layer(n_in, n_out):
        linear = bnb.nn.Linear4bit(
            n_in, n_out, bias=False, compute_dtype=dtype, quant_type="nf4", compress_statistics=True
        )
        linear.weight = bnb.nn.Params4bit(
            torch.randn(n_out, n_in, dtype=dtype) * 0.02,
            requires_grad=False,
            quant_type="nf4",
            compress_statistics=True,
        )
        return linear.to("cuda")

    gate, up, down = layer(hidden, intermediate), layer(hidden, intermediate), layer(intermediate, hidden)
    for linear in (gate, up, down):
        assert linear.weight.quant_state.dtype == dtype and linear.weight.quant_state.nested
        _assert_same(
            nf4convert.dequantize_4bit(linear.weight), F.dequantize_4bit(linear.weight.data, linear.weight.quant_state)
        )
    x = torch.randn(batch, seq, hidden, device="cuda", dtype=dtype)
    ours = lambda linear: nf4convert.dequantize_4bit(linear.weight)  # noqa: E731
    hidden_ours = torch.nn.functional.silu(x @ ours(gate).t()) * (x @ ours(up).t())
    with torch.no_grad():
        hidden_bnb = torch.nn.functional.silu(gate(x)) * up(x)
        torch.testing.assert_close(hidden_ours @ ours(down).t(), down(hidden_bnb), rtol=2e-2, atol=2e-2)


def test_repeat_calls_replay_and_notice_changes():
    from nf4convert import dequantize as module

    packed, state = quantize(
        (640, 1000), quant_type="nf4", blocksize=64, nested=True, dtype=torch.bfloat16, device="cuda"
    )
    first = nf4convert.dequantize_4bit(packed, state)
    assert state in module._replays  # the second call takes the replay path
    for _ in range(3):
        _assert_same(nf4convert.dequantize_4bit(packed, state), first)
    # A quant state whose tensors were replaced is launched afresh, not replayed with stale pointers.
    state.state2.absmax = state.state2.absmax * 2
    _assert_same(nf4convert.dequantize_4bit(packed, state), F.dequantize_4bit(packed, state))
    state.absmax = state.absmax.flip(0)
    _assert_same(nf4convert.dequantize_4bit(packed, state), F.dequantize_4bit(packed, state))
    # A different packed tensor with the same quant state is not the same launch either.
    other = packed.clone()
    _assert_same(nf4convert.dequantize_4bit(other, state), F.dequantize_4bit(other, state))
    # The entry goes with its quant state (a finalizer), so the cache cannot grow with dead weights.
    entries = len(module._replays)
    del state
    import gc

    gc.collect()
    assert len(module._replays) == entries - 1


@pytest.mark.parametrize(
    "builder,variant",
    [
        ("checkpoints", "llama-nf4-dq"),
        ("checkpoints", "phi3-fused-fp4-dq"),
        ("checkpoints", "qwen2-tied-fp4"),
        ("checkpoints8", "llama-8bit-bf16"),
        ("checkpoints8", "phi3-fused-8bit-fp16"),
        ("checkpoints", "gpt2-conv1d-nf4-dq"),
        ("checkpoints8", "gpt2-conv1d-8bit-bf16"),
    ],
)
def test_cli_convert_on_cuda_matches_cpu_and_bnb_cuda(builder, variant, tmp_path):
    import importlib

    from click.testing import CliRunner

    from nf4convert.cli.commands import main

    source = importlib.import_module(f"fixtures.{builder}").build(tmp_path / "src", variant)
    for device in ("cuda", "cpu"):
        result = CliRunner().invoke(main, [str(source), "-o", str(tmp_path / device), "--device", device, "-q"])
        assert result.exit_code == 0, result.output
    for shard in (tmp_path / "cpu").glob("*.safetensors"):
        assert shard.read_bytes() == (tmp_path / "cuda" / shard.name).read_bytes()  # the GPU and CPU routes agree
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "cuda"), str(source), "--device", "cuda"])
    assert result.exit_code == 0 and "on cuda" in result.output and "OK: bit-exact" in result.output, result.output


@pytest.mark.parametrize(
    "name,config",
    [
        ("persistent", dict(tile_bytes=2048, num_warps=4, evict=True, programs_per_sm=4, stages=2)),
        ("select", dict(tile_bytes=1024, num_warps=4, evict=False, lut_select=True)),
        ("big-tiles", dict(tile_bytes=8192, num_warps=8, evict=True)),
        ("fp32-large", dict(tile_bytes=4096, num_warps=8, evict=True)),
        ("h200-16bit-large", dict(tile_bytes=4096, num_warps=4, evict=True)),
    ],
)
def test_launch_variants_bit_exact(name, config):
    from nf4convert.kernels import configs

    with configs.override(configs.Config(**config)):
        _check_shapes()


def test_large_fp32_weight_takes_its_own_row_bit_exact():
    # Past 64 MiB packed, fp32 outputs have their own row in the default launch table.
    from nf4convert.kernels import configs

    shape = (16400, 8192)  # 67.2 MB packed
    packed, state = quantize(shape, quant_type="nf4", blocksize=64, nested=True, dtype=torch.float32, device="cuda")
    capability = torch.cuda.get_device_capability()
    if configs.table_for(capability) is configs.CONFIGS[()]:
        assert configs.choose_config(packed.numel() * packed.element_size(), capability, "", 4).num_warps == 8
    _assert_same(nf4convert.dequantize_4bit(packed, state), F.dequantize_4bit(packed, state))


def test_large_16bit_weight_takes_this_gpus_row_bit_exact():
    # Past 64 MiB packed, 16-bit outputs on an H200 take its own row (4 KiB tiles over 4 warps).
    from nf4convert.kernels import configs

    packed, state = quantize(
        (16400, 8192), quant_type="nf4", blocksize=64, nested=True, dtype=torch.bfloat16, device="cuda"
    )
    name = torch.cuda.get_device_name()
    config = configs.choose_config(packed.numel() * packed.element_size(), torch.cuda.get_device_capability(), name, 2)
    if "H200" in name:
        assert config == configs.Config(4096, 4, True)
    _assert_same(nf4convert.dequantize_4bit(packed, state), F.dequantize_4bit(packed, state))


def _check_shapes():
    for shape, quant_type, nested, dtype in (
        ((4096, 4096), "nf4", True, torch.bfloat16),
        ((777, 333), "fp4", False, torch.float16),
        ((3000, 1024), "fp4", True, torch.float32),
    ):
        packed, state = quantize(shape, quant_type=quant_type, blocksize=64, nested=nested, dtype=dtype, device="cuda")
        _assert_same(nf4convert.dequantize_4bit(packed, state), F.dequantize_4bit(packed, state))


@pytest.mark.parametrize("capability", [(7, 5), (9, 0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sm75_code_path_runs_bit_exact_on_this_gpu(dtype, capability, tmp_path):
    # The T4 build (sm_75 PTX: integer bf16 rounding, L1-only hints) JIT-compiled by the driver for
    # this GPU and launched through CuPy, against bitsandbytes' CUDA kernel.
    cupy = pytest.importorskip("cupy")
    import numpy

    from nf4convert.dequantize import _code_table, _fields

    from fixtures.aot_build import compile_for

    for nested in (True, False):
        packed, state = quantize(
            (1000, 4104), quant_type="fp4" if nested else "nf4", blocksize=64, nested=nested, dtype=dtype, device="cuda"
        )
        n = state.shape.numel()
        compiled, grid, constexprs = compile_for(capability, dtype, nested, n_elements=n)
        assert f".target sm_{capability[0]}{capability[1]}" in compiled.asm["ptx"]
        ptx = tmp_path / f"kernel-{nested}.ptx"  # one file per build: CuPy caches modules by path
        ptx.write_text(compiled.asm["ptx"])
        function = cupy.RawModule(path=str(ptx)).get_function("dequantize_4bit_kernel")
        absmax, code2, absmax2, offset, _ = _fields(packed, state, None, "triton")
        code = _code_table(state.quant_type, packed.device)
        out = torch.full(tuple(state.shape), float("nan"), dtype=dtype, device="cuda")
        pointers = [
            t.data_ptr()
            for t in (
                packed,
                absmax,
                code2 if nested else absmax,
                absmax2 if nested else absmax,
                offset if nested else absmax,
                code,
                out,
            )
        ]
        n_params = compiled.asm["ptx"].split(".entry", 1)[1].split(")", 1)[0].count(".param")
        scratch = [numpy.uint64(0)] * (n_params - 9)  # Triton's global/profile scratch pointers, unused here
        torch.cuda.synchronize()
        function(
            grid,
            (compiled.metadata.num_warps * 32,),
            (*map(numpy.uint64, pointers), numpy.int32(n), numpy.int32((n + 1) // 2), *scratch),
            shared_mem=compiled.metadata.shared,
        )
        cupy.cuda.runtime.deviceSynchronize()
        _assert_same(out, F.dequantize_4bit(packed, state))


@pytest.mark.parametrize("kind", ["linear", "rslora-dora", "embedding", "modules_to_save"])
def test_adapter_merge_on_cuda_equals_peft_on_cuda(kind, tmp_path):
    # GPU output = peft on the GPU: the dense conversion loaded on CUDA, PeftModel.merge_and_unload() there.
    from click.testing import CliRunner
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from nf4convert.cli.commands import main

    from fixtures.adapters import KINDS, make_adapter
    from fixtures.checkpoints import build

    source = build(tmp_path / "src", "llama-nf4-dq", seed=3)
    adapter = make_adapter(tmp_path / "adapter", kind, seed=list(KINDS).index(kind) + 20)
    for args in (
        [str(source), "-o", str(tmp_path / "dense")],
        [str(source), "--adapter", str(adapter), "-o", str(tmp_path / "merged")],
    ):
        result = CliRunner().invoke(main, [*args, "--device", "cuda", "-q"])
        assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.bfloat16).to("cuda")
    expected = PeftModel.from_pretrained(model, adapter).merge_and_unload().state_dict()
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    for name, tensor in merged.items():
        _assert_same(tensor, expected[name].cpu().contiguous())
    result = CliRunner().invoke(
        main, ["verify", str(tmp_path / "merged"), str(source), "--adapter", str(adapter), "--device", "cuda", "-q"]
    )
    assert result.exit_code == 0 and "OK: bit-exact" in result.output, result.output
