"""Bit-exactness of the CPU path and of the Triton kernel under the interpreter, on the CPU.

Every case draws fresh shapes and weights; the seed is printed in the test id so a failure can be
replayed. The reference is nf4convert.reference (see helpers.bnb_reference_cpu), checked on its own by
test_cuda_arithmetic.py.
"""

import os
import random

import pytest
import torch

import nf4convert

from fixtures.weights import OUT_DTYPES, STORAGE_DTYPES, bits, bnb_reference_cpu, nibbles, quantize

pytest.importorskip("bitsandbytes")

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
FLT_MIN = 2.0**-126
_rng = random.Random(20261123)  # fixed: the same cases (and test ids) every run


def _random_shape(max_elements):
    kind = _rng.choice(("tiny", "odd", "partial", "rows"))
    if kind == "tiny":
        return (_rng.randint(1, 5), _rng.randint(1, 7))
    if kind == "odd":  # odd element count: the last byte holds one element
        return (_rng.randrange(1, 60, 2), _rng.randrange(1, 300, 2))
    if kind == "partial":  # the last quant block is partial
        return (_rng.randint(1, 9), _rng.randint(1, max_elements // 10))
    return (_rng.randint(2, 64), 2 * _rng.randint(1, max_elements // 128))


def _cases(count, max_elements):
    cases = []
    for index in range(count):
        seed = _rng.randrange(1 << 30)
        cases.append(
            pytest.param(
                _random_shape(max_elements),
                BLOCKSIZES[index % len(BLOCKSIZES)],
                ("nf4", "fp4")[index % 2],
                bool((index // 2) % 2),
                OUT_DTYPES[index % 3],
                seed,
                id=f"case{index}-seed{seed}",
            )
        )
    return cases


def _check(shape, blocksize, quant_type, nested, dtype, seed, backend):
    packed, state = quantize(shape, quant_type=quant_type, blocksize=blocksize, nested=nested, dtype=dtype, seed=seed)
    expected = bnb_reference_cpu(packed, state)
    got = nf4convert.dequantize_4bit(packed, state, backend=backend)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    mismatches = (bits(got) != bits(expected)).sum().item()
    assert mismatches == 0, f"{mismatches} of {got.numel()} elements differ"


@pytest.mark.parametrize("shape,blocksize,quant_type,nested,dtype,seed", _cases(48, 200_000))
def test_cpu_path_bit_exact(shape, blocksize, quant_type, nested, dtype, seed):
    _check(shape, blocksize, quant_type, nested, dtype, seed, "cpu")


@pytest.mark.skipif(not INTERPRETING, reason="Triton's interpreter: no GPU, Triton installed")
@pytest.mark.parametrize("shape,blocksize,quant_type,nested,dtype,seed", _cases(32, 40_000))
def test_triton_kernel_interpreted_bit_exact(shape, blocksize, quant_type, nested, dtype, seed):
    _check(shape, blocksize, quant_type, nested, dtype, seed, "triton")


@pytest.mark.parametrize("storage", STORAGE_DTYPES)
@pytest.mark.parametrize(
    "backend", ["cpu", pytest.param("triton", marks=pytest.mark.skipif(not INTERPRETING, reason="no interpreter"))]
)
def test_packed_storage_dtypes(storage, backend):
    # bitsandbytes needs the packed bytes to fill whole storage elements: 4 * k bytes.
    shape = (_rng.randint(1, 40) * 2, 4 * _rng.randint(1, 50))
    for quant_type in ("nf4", "fp4"):
        packed, state = quantize(
            shape, quant_type=quant_type, blocksize=64, nested=True, dtype=torch.bfloat16, storage=storage
        )
        assert packed.dtype == storage
        got = nf4convert.dequantize_4bit(packed, state, backend=backend)
        assert torch.equal(bits(got), bits(bnb_reference_cpu(packed, state)))


def test_params4bit_and_out():
    import bitsandbytes as bnb

    weight = torch.randn(48, 80) * 0.1
    param = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=True)
    param = param._quantize("cpu") if hasattr(param, "_quantize") else param
    expected = bnb_reference_cpu(param.data, param.quant_state)
    assert torch.equal(bits(nf4convert.dequantize_4bit(param)), bits(expected))
    out = torch.full((48 * 80,), float("nan"), dtype=param.quant_state.dtype)
    result = nf4convert.dequantize_4bit(param.data, param.quant_state, out=out)
    assert result.shape == (48, 80) and result.data_ptr() == out.data_ptr()
    assert torch.equal(bits(out), bits(expected))


def test_fp4_zero_is_negative_like_cuda():
    # Nibble 8 of FP4 is -0.0 in bitsandbytes' CUDA kernel: a positive scale keeps the sign.
    import bitsandbytes.functional as F

    packed = torch.tensor([0x88, 0x08, 0x80], dtype=torch.uint8)
    state = F.QuantState(
        absmax=torch.tensor([0.5]),
        shape=torch.Size([6]),
        dtype=torch.float32,
        blocksize=64,
        quant_type="fp4",
        code=F.get_4bit_type("fp4", device="cpu"),
    )
    got = nf4convert.dequantize_4bit(packed, state, backend="cpu")
    assert torch.signbit(got).tolist() == [True, True, False, True, True, False]
    assert got.abs().tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def _state(**overrides):
    import bitsandbytes.functional as F

    packed, state = F.quantize_4bit(torch.randn(16, 32), blocksize=64, quant_type="nf4", compress_statistics=True)
    for key, value in overrides.items():
        setattr(state, key, value)
    return packed, state


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"blocksize": 48}, "blocksize must be one of"),
        ({"quant_type": "int4"}, "quant_type must be"),
        ({"dtype": torch.int8}, "dtype must be"),
        ({"shape": torch.Size([16, 33])}, "packed bytes do not hold shape"),
    ],
)
def test_bad_quant_state_raises(overrides, message):
    packed, state = _state(**overrides)
    with pytest.raises(ValueError, match=message):
        nf4convert.dequantize_4bit(packed, state)


def _broken(field, value):
    def apply(state):
        owner = state.state2 if field.startswith("state2.") else state
        setattr(owner, field.removeprefix("state2."), value)
        return state

    return apply


# (how the quant state is broken, the message): each a field the kernels read, of the wrong type or missing
MALFORMED = {
    "dict": (
        lambda state: state.as_dict(),
        r"quant_state must be a bitsandbytes QuantState or nf4convert\.QuantState4bit, not dict "
        r"\(bitsandbytes' QuantState\.from_dict makes one\)",
    ),
    "empty-dict": (
        lambda state: {},
        r"quant_state must be a bitsandbytes QuantState or nf4convert\.QuantState4bit, not dict "
        r"\(bitsandbytes' QuantState\.from_dict makes one\)",
    ),
    "absmax-2d": (
        lambda state: _broken("absmax", state.absmax.reshape(-1, 1))(state),
        r"quant_state\.absmax has shape \[\d+, 1\]; bitsandbytes keeps the parts of a quant state 1-D",
    ),
    "state2.absmax-2d": (
        lambda state: _broken("state2.absmax", state.state2.absmax.reshape(1, -1))(state),
        r"quant_state\.state2\.absmax has shape \[1, \d+\]; bitsandbytes keeps the parts of a quant state 1-D",
    ),
    "quant_type-None": (_broken("quant_type", None), r"quant_state\.quant_type must be 'nf4' or 'fp4', not None"),
    "dtype-str": (
        _broken("dtype", "bfloat16"),
        r"quant_state\.dtype must be torch\.float16, torch\.bfloat16 or torch\.float32, "
        r"not 'bfloat16' \(str, not a torch\.dtype\)",
    ),
    "blocksize-None": (_broken("blocksize", None), r"quant_state\.blocksize must be one of \(32, .*\), not None"),
    "blocksize-float": (_broken("blocksize", 64.0), r"quant_state\.blocksize must be one of \(32, .*\), not 64\.0"),
    "shape-None": (_broken("shape", None), r"quant_state\.shape must be a sequence of non-negative ints, not None"),
    "shape-floats": (
        _broken("shape", [16.0, 32.0]),
        r"quant_state\.shape must be a sequence of non-negative ints, not \[16\.0, 32\.0\]",
    ),
    "absmax-None": (_broken("absmax", None), r"quant_state\.absmax must be a tensor, not NoneType"),
    "absmax-list": (_broken("absmax", [1.0] * 8), r"quant_state\.absmax must be a tensor, not list"),
    "nested-None": (_broken("nested", None), r"quant_state\.nested must be True or False, not None"),
    "state2-None": (_broken("state2", None), r"quant_state\.state2 is None; a nested quant state needs its state2"),
    "state2-dict": (
        lambda state: _broken("state2", state.state2.as_dict())(state),
        r"quant_state\.state2 must be a bitsandbytes QuantState or nf4convert's NestedState, not dict",
    ),
    "state2.absmax-None": (
        _broken("state2.absmax", None),
        r"quant_state\.state2\.absmax must be a tensor, not NoneType",
    ),
    "state2.code-None": (_broken("state2.code", None), r"quant_state\.state2\.code must be a tensor, not NoneType"),
    "state2.blocksize-None": (
        _broken("state2.blocksize", None),
        r"quant_state\.state2\.blocksize must be a power of two, not None",
    ),
    "offset-None": (_broken("offset", None), r"quant_state\.offset is None; a nested quant state needs its offset"),
    "offset-str": (_broken("offset", "0.1"), r"quant_state\.offset must be a tensor or a number, not str"),
    "offset-2-elements": (
        _broken("offset", torch.zeros(2)),
        r"quant_state\.offset must be one number, not a tensor of 2 elements",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_quant_state_is_one_line_naming_the_field(case):
    # The docstring's promise: a quant state that cannot be dequantized is an ArgumentError, never an AttributeError
    # or TypeError from deep inside.
    from nf4convert import ArgumentError

    broken, message = MALFORMED[case]
    packed, state = _state()
    with pytest.raises(ArgumentError, match=f"^{message}$"):
        nf4convert.dequantize_4bit(packed, broken(state))


def test_ours_without_offset_and_out_not_a_tensor_are_argument_errors():
    from nf4convert import ArgumentError
    from nf4convert.formats.bnb4 import NestedState

    packed, state = _state()
    nested = NestedState(state.state2.absmax, state.state2.code, state.state2.blocksize)
    ours = nf4convert.QuantState4bit(
        absmax=state.absmax,
        shape=state.shape,
        dtype=state.dtype,
        blocksize=64,
        quant_type="nf4",
        offset=None,
        state2=nested,
    )
    with pytest.raises(ArgumentError, match=r"^quant_state\.offset is None; a nested quant state needs its offset$"):
        nf4convert.dequantize_4bit(packed, ours, backend="cpu")
    packed, state = _state()
    for out, name in (([0] * 512, "list"), (torch.empty(512).numpy(), "ndarray")):
        with pytest.raises(ArgumentError, match=f"^out must be a tensor, not {name}$"):
            nf4convert.dequantize_4bit(packed, state, out=out)


def test_bad_out_and_backend_raise():
    packed, state = _state()
    with pytest.raises(ValueError, match="out has dtype"):
        nf4convert.dequantize_4bit(packed, state, out=torch.empty(512, dtype=torch.float64))
    with pytest.raises(ValueError, match="out has 511 elements"):
        nf4convert.dequantize_4bit(packed, state, out=torch.empty(511, dtype=state.dtype))
    with pytest.raises(ValueError, match="backend must be one of"):
        nf4convert.dequantize_4bit(packed, state, backend="cuda")
    with pytest.raises(ValueError, match="absmax has"):
        state.absmax = state.absmax[:-1]
        nf4convert.dequantize_4bit(packed, state)


@pytest.mark.parametrize("nested", [True, False])
def test_quant_state_from_checkpoint_and_chunks_match_bnb(nested, tmp_path):
    # formats.bnb4 reads a weight as a checkpoint stores it (bitsandbytes' own as_dict), and its chunks of
    # whole (nested) blocks dequantize, one by one, to the same bits as the whole weight.
    from safetensors.torch import save_file

    from nf4convert.formats import bnb4, bnb4_weights
    from nf4convert.safetensors_io.read import TensorReader, read_tensors

    packed, state = quantize((37, 911), quant_type="fp4", blocksize=128, nested=nested, dtype=torch.float16, seed=5)
    stored = {f"w.{key}": value for key, value in state.as_dict(packed=True).items()}
    save_file({"w": packed, **stored}, tmp_path / "model.safetensors")
    with TensorReader() as reader:
        (weight,) = bnb4_weights.find_weights(read_tensors(tmp_path), reader)
        ours = bnb4.on_device(bnb4_weights.load_state(weight, reader), "cpu")
    assert weight.name == "w" and ours.nested == nested and ours.shape == state.shape and ours.dtype == torch.float16
    expected = bnb_reference_cpu(packed, state)
    assert torch.equal(bits(nf4convert.dequantize_4bit(packed, ours, backend="cpu")), bits(expected))
    flat = packed.view(torch.uint8).view(-1)
    pieces = []
    for first, count, piece in bnb4.chunks(ours, 1 if nested else 128 * 3 + 5):  # rounded to whole (nested) blocks
        pieces.append(
            nf4convert.dequantize_4bit(
                flat[first // 2 : first // 2 + (count + 1) // 2].contiguous(), piece, backend="cpu"
            )
        )
    assert len(pieces) > 1
    assert torch.equal(bits(torch.cat(pieces)), bits(expected))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_agrees_with_bnb_native_cpu_where_it_is_exact(quant_type):
    # Where bitsandbytes' native CPU op is right (rows of whole blocks), it agrees with us directly,
    # so the reference above is not circular. FP4 zeros are compared by value: the op gives +0.0.
    import bitsandbytes.functional as F

    blocksize = _rng.choice((64, 128, 256))
    shape = (_rng.randint(1, 40), blocksize * _rng.randint(1, 8))
    packed, state = quantize(shape, quant_type=quant_type, blocksize=blocksize, nested=True, dtype=torch.float16)
    expected = F.dequantize_4bit(packed, state)
    got = nf4convert.dequantize_4bit(packed, state, backend="cpu")
    if quant_type == "nf4":
        assert torch.equal(bits(got), bits(expected))
    else:
        assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "backend", ["cpu", pytest.param("triton", marks=pytest.mark.skipif(not INTERPRETING, reason="no interpreter"))]
)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_subnormal_products_flush_like_cuda(backend, quant_type):
    # bitsandbytes' CUDA kernel multiplies with flush-to-zero (seen on an H100): scales near 1e-38
    # give zeros of the product's sign. The reference flushes by itself; the exact products (float64)
    # show that subnormal products do occur here and that the reference turns them into signed zeros.
    import bitsandbytes.functional as F

    seed = {"nf4": 8128, "fp4": 8129}[quant_type]
    packed, state = quantize(
        (24, 200), quant_type=quant_type, blocksize=64, nested=False, dtype=torch.float32, seed=seed
    )
    state.absmax = state.absmax * torch.logspace(-40, -30, state.absmax.numel())
    code = F.get_4bit_type(quant_type, device="cpu").double()
    exact = code[nibbles(packed, 24 * 200)] * state.absmax.double().repeat_interleave(64)[: 24 * 200]
    subnormal = (exact != 0) & (exact.abs() < FLT_MIN / 2)  # clear of the rounding window just below FLT_MIN
    assert subnormal.sum() > 100
    for dtype in OUT_DTYPES:
        state.dtype = dtype
        expected = bnb_reference_cpu(packed, state).view(-1)
        assert (expected[subnormal] == 0).all()
        assert torch.equal(torch.signbit(expected[subnormal]), exact[subnormal] < 0)
        got = nf4convert.dequantize_4bit(packed, state, backend=backend)
        assert torch.equal(bits(got), bits(expected))


@pytest.mark.skipif(not INTERPRETING, reason="Triton's interpreter: no GPU, Triton installed")
@pytest.mark.parametrize("config", ["persistent", "select", "small-tiles"])
def test_kernel_variants_interpreted(config):
    # Every launch variant the benchmark may pick computes the same bits.
    from nf4convert.kernels import configs

    with configs.override(
        {
            "persistent": configs.Config(256, 4, True, programs_per_sm=3, stages=2),
            "select": configs.Config(512, 4, False, lut_select=True),
            "small-tiles": configs.Config(64, 2, False),
        }[config]
    ):
        for quant_type, nested, dtype in (
            ("nf4", True, torch.bfloat16),
            ("fp4", False, torch.float16),
            ("fp4", True, torch.float32),
        ):
            shape = (_rng.randint(3, 40), _rng.randint(100, 700))
            packed, state = quantize(shape, quant_type=quant_type, blocksize=64, nested=nested, dtype=dtype)
            got = nf4convert.dequantize_4bit(packed, state, backend="triton")
            assert torch.equal(bits(got), bits(bnb_reference_cpu(packed, state)))


@pytest.mark.parametrize(
    "backend", ["cpu", pytest.param("triton", marks=pytest.mark.skipif(not INTERPRETING, reason="no interpreter"))]
)
@pytest.mark.parametrize("case", ["nf4", "fp4", "nested-offset-0", "nested-offset-tiny", "nested-offset-negative"])
def test_products_just_below_flt_min_flush_like_cuda(backend, case):
    # mul.ftz.f32 flushes a product whose 24-bit rounding (unbounded exponent) is below FLT_MIN, even where
    # rounding to the subnormal grid would give FLT_MIN; subnormal operands read as zeros (measured on an H100).
    from test_cuda_arithmetic import nested_window_state, window_state

    if case.startswith("nested"):
        offset = {"nested-offset-0": 0.0, "nested-offset-tiny": 2.0**-140, "nested-offset-negative": -3e-38}[case]
        packed, state = nested_window_state(offset, seed=17)
    else:
        packed, state = window_state(case, seed=19)
    expected = bnb_reference_cpu(packed, state)
    got = nf4convert.dequantize_4bit(packed, state, backend=backend)
    assert torch.equal(bits(got), bits(expected))


@pytest.mark.parametrize("chunk_bytes", [16, 48, 100, 4096])
def test_cpu_path_chunks_bit_exact(chunk_bytes, monkeypatch):
    # The CPU path decodes in chunks of whole blocks (a partial last block, an odd byte and tiny scales in
    # some of them). Small chunks put many boundaries inside each weight, between blocks of every size.
    from nf4convert.kernels import cpu

    monkeypatch.setattr(cpu, "CHUNK_BYTES", chunk_bytes)
    for index in range(12):
        shape = _random_shape(30_000)
        blocksize = BLOCKSIZES[index % 4]  # 32 to 256: chunks of a few blocks
        nested, dtype = bool(index % 2), OUT_DTYPES[index % 3]
        packed, state = quantize(
            shape,
            quant_type=("nf4", "fp4")[index // 2 % 2],
            blocksize=blocksize,
            nested=nested,
            dtype=dtype,
            seed=index,
        )
        expected = bnb_reference_cpu(packed, state)
        got = nf4convert.dequantize_4bit(packed, state, backend="cpu")
        assert torch.equal(bits(got), bits(expected)), (shape, blocksize, nested, dtype)


@pytest.mark.parametrize("nan", [False, True])
def test_cpu_path_tiny_scales_in_some_chunks(nan, monkeypatch):
    # Scales near 1e-38 in some blocks only (and NaN scales beside them, in the same chunks): every chunk must
    # still flush its subnormal products like CUDA, whichever chunk the tiny scales fall in.
    import bitsandbytes.functional as F

    from nf4convert.kernels import cpu

    monkeypatch.setattr(cpu, "CHUNK_BYTES", 64)  # two blocks of 64 per chunk
    packed, state = quantize((24, 200), quant_type="nf4", blocksize=64, nested=False, dtype=torch.float32, seed=8128)
    n_blocks = state.absmax.numel()
    absmax = state.absmax.clone()
    absmax[8:40] *= torch.logspace(-40, -30, 32)
    if nan:
        absmax[9:40:4] = float("nan")  # the odd block of every other chunk of tiny ones
    state.absmax = absmax
    code = F.get_4bit_type("nf4", device="cpu").double()
    exact = code[nibbles(packed, 24 * 200)] * absmax.double().repeat_interleave(64)[: 24 * 200]
    subnormal = (exact != 0) & (exact.abs() < FLT_MIN / 2)
    assert subnormal.sum() > 100 and n_blocks > 40
    for dtype in OUT_DTYPES:
        state.dtype = dtype
        expected = bnb_reference_cpu(packed, state)
        assert (expected.view(-1)[subnormal] == 0).all()
        got = nf4convert.dequantize_4bit(packed, state, backend="cpu")
        assert torch.equal(bits(got), bits(expected))


def test_tensors_on_an_amd_gpu_are_refused_in_one_line(monkeypatch):
    # torch's "cuda" device on a ROCm build is an AMD GPU: the Triton kernel (NVIDIA PTX) cannot run there
    from nf4convert.dequantize import _pick_backend, _refuse_amd
    from nf4convert.errors import ArgumentError

    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    with pytest.raises(ArgumentError, match=r"^packed is on an AMD GPU \(ROCm\), .*; dequantize a copy on the CPU"):
        _refuse_amd(torch.device("cuda"))
    _refuse_amd(torch.device("cpu"))
    assert _pick_backend("auto", torch.device("cpu")) == "cpu"
