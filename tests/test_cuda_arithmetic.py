"""nf4convert.reference on its own: against bitsandbytes' native CPU op where that op is right, against an
independent float64 model of the CUDA arithmetic everywhere, and (on a GPU) against bitsandbytes' CUDA
kernels bit for bit.

The float64 model computes each product exactly and applies CUDA's ``mul.ftz.f32`` rule (subnormal
operands read as signed zeros; a product flushed to a signed zero when, rounded to 24 bits with an
unbounded exponent, it is below FLT_MIN) by scaling by 2^200 instead of the reference's 2^24 lift.
"""

import ast
import math
import random
from pathlib import Path

import pytest
import torch

from fixtures.weights import OUT_DTYPES, bits, nibbles, quantize

F = pytest.importorskip("bitsandbytes.functional")

from nf4convert.errors import CheckpointError  # noqa: E402
from nf4convert.verification.reference import cuda_arithmetic as reference  # noqa: E402

FLT_MIN = 2.0**-126
CUDA = torch.cuda.is_available()
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


# ---- the independent model ------------------------------------------------------------------------


def _operand(values: torch.Tensor) -> torch.Tensor:
    """float64 copy with subnormals read as zeros of their sign (mul.ftz's operands)."""
    values = values.double()
    return torch.where(values.abs() < FLT_MIN, values * 0.0, values)


def _ftz(exact: torch.Tensor) -> torch.Tensor:
    """fp32 result of mul.rn.ftz.f32 for exact float64 products."""
    rounded24 = (exact * 2.0**200).float().double() / 2.0**200  # 24-bit rounding, exponent out of the way
    return torch.where(rounded24.abs() < FLT_MIN, exact * 0.0, exact).float()


def cuda_code(quant_type):
    code = F.get_4bit_type(quant_type, device="cpu").double().clone()
    if quant_type == "fp4":
        code[8] = -0.0
    return code


def model(packed, state, dtype):
    n = math.prod(state.shape)
    if state.nested:
        blocks = torch.arange(state.absmax.numel())
        code2 = _operand(state.state2.code).index_select(0, state.absmax.long())
        products = code2 * _operand(state.state2.absmax).index_select(0, blocks // state.state2.blocksize)
        scale = _ftz(products) + torch.as_tensor(state.offset, dtype=torch.float32)  # fp32 add
    else:
        scale = state.absmax.float()
    code = cuda_code(state.quant_type).index_select(0, nibbles(packed, n).long())
    exact = code * _operand(scale).repeat_interleave(state.blocksize)[:n]
    return _ftz(exact).to(dtype).reshape(state.shape)


def _mismatches(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    return (bits(got) != bits(want)).sum().item()


# ---- weights whose products straddle FLT_MIN ------------------------------------------------------


def _window_hits(code_value: float, rng: random.Random, per_window=6):
    """fp32 scales a whose exact product with ``code_value`` lands in each rounding window below FLT_MIN:
    W1 = [FLT_MIN - 2^-150, FLT_MIN - 2^-151) (flushed by CUDA, kept by 'round then flush subnormals'),
    W2 = [FLT_MIN - 2^-151, FLT_MIN) (kept as FLT_MIN), plus a few clear subnormals and normals."""
    centre = torch.tensor([FLT_MIN / abs(code_value)], dtype=torch.float32).view(torch.int32).item()
    candidates = (torch.arange(-60_000, 60_000, dtype=torch.int64) + centre).to(torch.int32).view(torch.float32)
    exact = candidates.double() * abs(code_value)
    w1 = (exact >= FLT_MIN - 2.0**-150) & (exact < FLT_MIN - 2.0**-151)
    w2 = (exact >= FLT_MIN - 2.0**-151) & (exact < FLT_MIN)
    picked = []
    for window in (w1, w2):
        index = window.nonzero().view(-1).tolist()
        picked += rng.sample(index, min(per_window, len(index)))
    picked += [0, len(candidates) // 2, len(candidates) - 1]  # well below, at, well above FLT_MIN / |c|
    return candidates[picked], int(w1.sum()), int(w2.sum())


def window_state(quant_type, seed):
    """Flat quant state, blocks of 32 holding every nibble twice in a shuffled order, one block per scale."""
    rng = random.Random(seed)
    code = cuda_code(quant_type)
    scales = []
    for value in sorted({abs(c) for c in code.tolist() if c != 0}):  # powers of two have no product in W1
        scales.append(_window_hits(value, rng)[0])
    absmax = torch.cat(scales)
    negative = torch.rand(absmax.numel(), generator=torch.Generator().manual_seed(seed)) < 0.3
    absmax = torch.where(negative, -absmax, absmax)
    order = [rng.sample(range(16), 16) + rng.sample(range(16), 16) for _ in range(absmax.numel())]
    nibble = torch.tensor(order, dtype=torch.uint8).view(-1, 2)
    packed = (nibble[:, 0] << 4) | nibble[:, 1]
    state = F.QuantState(
        absmax=absmax,
        shape=torch.Size([absmax.numel(), 32]),
        dtype=torch.float32,
        blocksize=32,
        quant_type=quant_type,
        code=F.get_4bit_type(quant_type, device="cpu"),
    )
    return packed, state


def nested_window_state(offset, seed):
    """Nested NF4 state whose nested products code2[q] * absmax2 straddle FLT_MIN; every element is
    nibble 15 (1.0) or 0 (-1.0), so the output is the decoded absmax itself (fp32: exact). The last
    nested block reads two subnormal code2 entries with a large absmax2: operands CUDA reads as zeros."""
    rng = random.Random(seed)
    code2 = F.create_dynamic_map().float()
    targets = rng.sample([q for q in range(1, 255) if code2[q] != 0], 8)
    absmax2, absmax_u8 = [], []
    for q in targets:
        hits, _, _ = _window_hits(code2[q].item(), rng, per_window=2)
        for scale in hits.tolist():
            absmax2.append(scale)
            absmax_u8 += [q] * 200 + [rng.randrange(256) for _ in range(56)]  # mostly q: on the window
    code2[0], code2[255] = 1e-39, -1e-39
    absmax2.append(1e6)
    absmax_u8 += [0, 255] * 128
    absmax_u8 = torch.tensor(absmax_u8, dtype=torch.uint8)
    n = absmax_u8.numel() * 32 - 7  # a partial last block and an odd count
    ones = torch.rand(n + 1, generator=torch.Generator().manual_seed(seed)) < 0.5
    nibble = torch.where(ones, 15, 0).to(torch.uint8).view(-1, 2)
    packed = (nibble[:, 0] << 4) | nibble[:, 1]
    absmax2 = torch.tensor(absmax2, dtype=torch.float32)
    state2 = F.QuantState(absmax=absmax2, code=code2, blocksize=256, dtype=torch.float32)
    state = F.QuantState(
        absmax=absmax_u8,
        shape=torch.Size([n]),
        dtype=torch.float32,
        blocksize=32,
        quant_type="nf4",
        code=F.get_4bit_type("nf4", device="cpu"),
        offset=torch.tensor(offset),
        state2=state2,
    )
    return packed, state


# ---- CPU tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("blocksize", [64, 128])
def test_agrees_with_bnb_native_cpu_where_it_is_right(blocksize, nested):
    # Rows of whole blocks, normal-range scales: there bitsandbytes' own CPU op computes what CUDA does,
    # for NF4 bit for bit and for FP4 up to the sign of nibble 8's zero (-0.0 on CUDA; +0.0 on the CPU
    # where bitsandbytes falls back to its torch code or uses AVX512, -0.0 in its plain C++ loop).
    # fp16 is left out: on CPUs with AVX512-FP16 the native op's fp16 differs from CUDA in ~1 of 5000.
    rng = random.Random(blocksize * 2 + nested)
    for quant_type in ("nf4", "fp4"):
        for dtype in (torch.bfloat16, torch.float32):
            shape = (rng.randint(1, 30), blocksize * rng.randint(1, 9))
            packed, state = quantize(
                shape,
                quant_type=quant_type,
                blocksize=blocksize,
                nested=nested,
                dtype=dtype,
                seed=rng.randrange(1 << 30),
            )
            native = F.dequantize_4bit(packed, state)
            got = reference.dequantize_4bit(packed, state, dtype=dtype, device="cpu")
            if quant_type == "nf4":
                assert _mismatches(got, native) == 0
            else:
                assert torch.equal(got, native)
                differ = (bits(got) != bits(native)).view(shape)
                assert not (differ & (nibbles(packed, math.prod(shape)) != 8).view(shape)).any()


def test_fp4_nibble_8_is_negative_zero():
    packed = torch.tensor([0x88, 0x08, 0x80, 0x00], dtype=torch.uint8)
    state = F.QuantState(
        absmax=torch.tensor([0.5]),
        shape=torch.Size([8]),
        dtype=torch.float32,
        blocksize=32,
        quant_type="fp4",
        code=F.get_4bit_type("fp4", device="cpu"),
    )
    for dtype in OUT_DTYPES:
        got = reference.dequantize_4bit(packed, state, dtype=dtype, device="cpu")
        assert got.abs().tolist() == [0.0] * 8
        # nibble 8 is -0.0 (times a positive scale: -0.0); nibble 0 is +0.0
        assert torch.signbit(got).tolist() == [True, True, False, True, True, False, False, False]
    state.absmax = torch.tensor([-0.5])  # the product's sign, as in CUDA: -0.0 * -0.5 = +0.0
    got = reference.dequantize_4bit(packed, state, dtype=torch.float32, device="cpu")
    assert torch.signbit(got).tolist() == [False, False, True, False, False, True, True, True]


def test_tables_are_the_cuda_kernels_constants():
    # The literals of nf4_dequantization_lut / fp4_dequantization_lut in bitsandbytes' csrc/kernels.cu.
    nf4 = (
        "-1.0 -0.6961928009986877 -0.5250730514526367 -0.39491748809814453 -0.28444138169288635 "
        "-0.18477343022823334 -0.09105003625154495 0.0 0.07958029955625534 0.16093020141124725 "
        "0.24611230194568634 0.33791524171829224 0.44070982933044434 0.5626170039176941 0.7229568362236023 1.0"
    )
    fp4_literals = "0.0 0.005208333333 0.66666667 1.0 0.33333333 0.5 0.16666667 0.25"
    fp4_lut = torch.tensor([float(v) for v in fp4_literals.split()])
    fp4 = torch.cat((fp4_lut, fp4_lut * -1.0))  # lut[v & 7] * (1 - 2 * (v >> 3))
    packed = torch.tensor([0x01, 0x23, 0x45, 0x67, 0x89, 0xAB, 0xCD, 0xEF], dtype=torch.uint8)
    for quant_type, want in (("nf4", torch.tensor([float(v) for v in nf4.split()])), ("fp4", fp4)):
        state = F.QuantState(
            absmax=torch.tensor([1.0]),
            shape=torch.Size([16]),
            dtype=torch.float32,
            blocksize=32,
            quant_type=quant_type,
            code=F.get_4bit_type(quant_type, device="cpu"),
        )
        got = reference.dequantize_4bit(packed, state, dtype=torch.float32, device="cpu")
        assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_products_below_flt_min_flush_like_cuda(quant_type):
    packed, state = window_state(quant_type, seed={"nf4": 71, "fp4": 72}[quant_type])
    exact = cuda_code(quant_type)[nibbles(packed, math.prod(state.shape))] * state.absmax.double().repeat_interleave(32)
    tiny = (exact != 0) & (exact.abs() < FLT_MIN)
    assert tiny.sum() > 100
    for dtype in OUT_DTYPES:
        got = reference.dequantize_4bit(packed, state, dtype=dtype, device="cpu")
        assert _mismatches(got, model(packed, state, dtype)) == 0
        flat = got.view(-1).float()
        window_w1 = (exact.abs() >= FLT_MIN - 2.0**-150) & (exact.abs() < FLT_MIN - 2.0**-151)
        clear = tiny & (exact.abs() < FLT_MIN - 2.0**-150)
        assert window_w1.any() and (flat[window_w1 | clear] == 0).all()  # flushed, though W1 rounds to FLT_MIN
        assert torch.equal(torch.signbit(flat[tiny & (flat == 0)]), exact[tiny & (flat == 0)] < 0)
        if dtype != torch.float16:  # fp16 has no FLT_MIN: every such product is 0 there
            window_w2 = (exact.abs() >= FLT_MIN - 2.0**-151) & (exact.abs() < FLT_MIN)
            assert window_w2.any() or quant_type == "fp4"  # FP4's k/3 values have no product in W2
            assert (flat[window_w2].abs() == FLT_MIN).all()


@pytest.mark.parametrize("offset", [0.0, 2.0**-140, -3e-38])
def test_nested_products_flush_then_offset_added(offset):
    packed, state = nested_window_state(offset, seed={0.0: 5, 2.0**-140: 6, -3e-38: 7}[offset])
    for dtype in OUT_DTYPES:
        got = reference.dequantize_4bit(packed, state, dtype=dtype, device="cpu")
        assert _mismatches(got, model(packed, state, dtype)) == 0
    # the fp32 output is +-A itself: A = flushed product + offset, and a subnormal A is read as zero
    got = reference.dequantize_4bit(packed, state, dtype=torch.float32, device="cpu")
    code2, absmax2 = state.state2.code.double(), state.state2.absmax.double()
    exact = code2[state.absmax.long()] * absmax2.repeat_interleave(256)[: state.absmax.numel()]
    in_w1 = (exact.abs() >= FLT_MIN - 2.0**-150) & (exact.abs() < FLT_MIN - 2.0**-151)
    assert in_w1.sum() > 100
    first_of_block = got[::32].abs()
    expected_w1 = torch.tensor(offset, dtype=torch.float32).abs()
    expected_w1 = expected_w1 if expected_w1 >= FLT_MIN else torch.tensor(0.0)
    assert (first_of_block[in_w1] == expected_w1).all()


@pytest.mark.parametrize("case", range(12))
def test_partial_blocks_and_odd_counts(case):
    rng = random.Random(3000 + case)
    blocksize = BLOCKSIZES[case % len(BLOCKSIZES)]
    quant_type, nested, dtype = ("nf4", "fp4")[case % 2], bool(case // 2 % 2), OUT_DTYPES[case % 3]
    n = blocksize * rng.randint(1, 40) + rng.randrange(1, blocksize, 2)  # odd: a partial block, a lone last nibble
    shape = (n,) if case // 4 % 2 else (1, n)
    packed, state = quantize(
        shape, quant_type=quant_type, blocksize=blocksize, nested=nested, dtype=dtype, seed=rng.randrange(1 << 30)
    )
    assert packed.numel() == (n + 1) // 2
    got = reference.dequantize_4bit(packed, state, dtype=dtype, device="cpu")
    assert got.shape == state.shape
    assert _mismatches(got, model(packed, state, dtype)) == 0
    for other in OUT_DTYPES:  # the output dtype is the caller's, whatever the state says
        got = reference.dequantize_4bit(packed, state, dtype=other, device="cpu")
        assert _mismatches(got, model(packed, state, other)) == 0


@pytest.mark.parametrize("nested", [False, True])
def test_chunks_give_the_bits_of_one_piece(nested, monkeypatch):
    rng = random.Random(41 + nested)
    for blocksize in (32, 256, 4096):
        n = blocksize * rng.randint(5, 40) + rng.randrange(1, blocksize, 2)
        packed, state = quantize(
            (n,),
            quant_type=rng.choice(("nf4", "fp4")),
            blocksize=blocksize,
            nested=nested,
            dtype=torch.float32,
            seed=rng.randrange(1 << 30),
        )
        # tiny scales in some blocks only, so chunks differ in whether they need the flush
        if nested:
            state.state2.absmax = state.state2.absmax * 1e-37
            state.offset = state.offset * 1e-37
        else:
            tiny = torch.rand(state.absmax.numel(), generator=torch.Generator().manual_seed(n)) < 0.3
            state.absmax = torch.where(tiny, state.absmax * 1e-37, state.absmax)
        monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 1 << 40)
        whole = reference.dequantize_4bit(packed, state, dtype=torch.bfloat16, device="cpu")
        assert _mismatches(whole, model(packed, state, torch.bfloat16)) == 0
        for chunk in (1, 3 * blocksize, 7 * blocksize + 5):
            monkeypatch.setattr(reference, "CHUNK_ELEMENTS", chunk)
            assert _mismatches(reference.dequantize_4bit(packed, state, dtype=torch.bfloat16, device="cpu"), whole) == 0


def test_packed_storage_dtypes_are_read_as_bytes():
    for storage in (torch.bfloat16, torch.float16, torch.float32):
        packed, state = quantize(
            (24, 40), quant_type="nf4", blocksize=64, nested=True, dtype=torch.float16, storage=storage, seed=9
        )
        assert packed.dtype == storage
        got = reference.dequantize_4bit(packed, state, dtype=torch.float16, device="cpu")
        assert _mismatches(got, model(packed.view(torch.uint8), state, torch.float16)) == 0


def test_state_from_checkpoint_tensors_and_bad_input():
    packed, state = quantize((33, 70), quant_type="fp4", blocksize=128, nested=True, dtype=torch.bfloat16, seed=11)
    tensors = {f"model.layers.0.mlp.up_proj.weight.{key}": value for key, value in state.as_dict(packed=True).items()}
    parsed = reference.quant_state_from_tensors(tensors, "cpu")
    assert len(tensors) == 5  # not consumed
    got = reference.dequantize_4bit(packed, parsed, dtype=torch.bfloat16, device="cpu")
    assert _mismatches(got, model(packed, state, torch.bfloat16)) == 0
    del tensors["model.layers.0.mlp.up_proj.weight.nested_absmax"]
    message = r"^model-1\.safetensors: model\.layers\.0\.mlp\.up_proj\.weight: .*nested"
    with pytest.raises(CheckpointError, match=message):
        reference.quant_state_from_tensors(tensors, "cpu", file="model-1.safetensors")
    with pytest.raises(ValueError, match="packed bytes do not hold shape"):
        reference.dequantize_4bit(packed[:-1], state, dtype=torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="dtype must be"):
        reference.dequantize_4bit(packed, state, dtype=torch.float64, device="cpu")
    with pytest.raises(ValueError, match="device meta is not supported"):
        reference.dequantize_4bit(packed, state, dtype=torch.float16, device="meta")
    state.state2.blocksize = 200
    with pytest.raises(ValueError, match="nested blocksize must be a power of two"):
        reference.dequantize_4bit(packed, state, dtype=torch.float16, device="cpu")


def test_reference_shares_no_code_with_our_kernels():
    tree = ast.parse(Path(reference.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {name for name in imported if "kernels" in name or "dequantize" in name}, imported


# ---- GPU: the reference is bitsandbytes' CUDA kernels ----------------------------------------------


def _cpu_state(state):
    """A copy of a CUDA quant state on the CPU, as verify would read it from a checkpoint."""
    tensors = {
        f"w.{key}": value.cpu() if isinstance(value, torch.Tensor) else value
        for key, value in state.as_dict(packed=True).items()
    }
    return reference.quant_state_from_tensors(tensors, "cpu")


def _cuda_truth(packed, state, dtype):
    """bitsandbytes' F.dequantize_4bit on CUDA at ``dtype``, called directly."""
    import copy

    cuda_state = copy.copy(state)
    cuda_state.dtype = dtype
    return F.dequantize_4bit(packed.cuda().view(torch.uint8).reshape(-1, 1), cuda_state).reshape(state.shape).cpu()


def _to_cuda(state):
    import copy

    state = copy.copy(state)
    state.absmax = state.absmax.cuda()
    if state.nested:
        state.offset = state.offset.cuda()
        state.state2 = copy.copy(state.state2)
        state.state2.absmax, state.state2.code = state.state2.absmax.cuda(), state.state2.code.cuda()
    return state


KINDS = ("rows", "odd", "partial", "tiny", "small")


def _gpu_cases():
    """Every blocksize x NF4/FP4 x nested/flat x kind, with fresh seeded shapes and weights. Kinds: rows of
    whole blocks, odd sizes, a partial last block; "tiny" scales near FLT_MIN / |code| (subnormal products;
    nested: tiny absmax2 and offset, so the nested products flush too); "small" scales, whose fp16 results
    are fp16 subnormals."""
    rng = random.Random(20261123)
    cases = []
    for index in range(len(BLOCKSIZES) * 2 * 2 * len(KINDS)):
        blocksize = BLOCKSIZES[index % len(BLOCKSIZES)]
        quant_type, nested = ("nf4", "fp4")[index // 8 % 2], bool(index // 16 % 2)
        kind = KINDS[index // 32]
        if kind == "rows":
            shape = (rng.randint(1, 64), blocksize * rng.randint(1, 12))
        elif kind == "odd":
            shape = (rng.randrange(1, 99, 2), rng.randrange(1, 999, 2))
        elif kind == "partial":
            shape = (rng.randint(1, 9), rng.randint(1, 30_000))
        else:  # hundreds of blocks, so scales spread over decades; a partial last block
            rows = rng.choice((1, 3))
            shape = (rows, rng.randint(300, 700) * blocksize // rows - rng.randrange(1, blocksize // 2))
        name = f"{kind}-{quant_type}-{'nested' if nested else 'flat'}-{blocksize}-{index}"
        cases.append(pytest.param(shape, blocksize, quant_type, nested, kind, rng.randrange(1 << 30), id=name))
    return cases


def _rescale(state, kind, rng):
    """Scale a CUDA quant state's scales down (after F.quantize_4bit): the median block scale to about
    FLT_MIN ("tiny"; flat: spread over six decades instead) or to about fp16's smallest normal ("small")."""
    if state.nested:
        scales = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    else:
        scales = state.absmax
    target = 2 * FLT_MIN if kind == "tiny" else 2.0**-14
    factor = target / scales.abs().median().item() * 10.0 ** rng.uniform(-0.5, 0.5)
    if state.nested and kind == "tiny":  # and the smallest nested product code2[q] * absmax2 below FLT_MIN / 4
        absmax2 = state.state2.absmax.repeat_interleave(256)[: state.absmax.numel()]
        products = (state.state2.code[state.absmax.long()] * absmax2).abs()
        factor = min(factor, FLT_MIN / 4 / products[products > 0].min().item())
    if state.nested:
        state.state2.absmax = state.state2.absmax * factor
        state.offset = state.offset * factor
    elif kind == "tiny":  # from subnormal scales (read as zeros) to products well above FLT_MIN
        spread = torch.logspace(-40, -34, state.absmax.numel(), dtype=torch.float64, device="cuda")
        state.absmax = state.absmax * spread.float()
    else:
        state.absmax = state.absmax * factor


@pytest.mark.gpu  # bitsandbytes' CUDA kernels are the truth
@pytest.mark.parametrize("shape,blocksize,quant_type,nested,kind,seed", _gpu_cases())
def test_gpu_reference_equals_bnb_cuda(shape, blocksize, quant_type, nested, kind, seed):
    from fixtures.weights import random_weight

    rng = random.Random(seed)
    weight = random_weight(shape, torch.float32, generator=torch.Generator().manual_seed(seed))
    packed, state = F.quantize_4bit(
        weight.cuda(), blocksize=blocksize, quant_type=quant_type, compress_statistics=nested
    )
    if kind in ("tiny", "small"):
        _rescale(state, kind, rng)
    cpu_state = _cpu_state(state)
    packed_cpu = packed.cpu()
    n = math.prod(shape)
    truths = {}
    for dtype in OUT_DTYPES:
        truth = truths[dtype] = _cuda_truth(packed, state, dtype)
        got = reference.dequantize_4bit(packed_cpu, cpu_state, dtype=dtype, device="cpu")
        differ = _mismatches(got, truth)
        assert differ == 0, f"{dtype}: {differ} of {n} differ from bitsandbytes' CUDA kernel"
        via_cuda = reference.dequantize_4bit(packed_cpu, cpu_state, dtype=dtype, device="cuda")
        assert via_cuda.device.type == "cuda" and _mismatches(via_cuda.cpu(), truth) == 0
    if kind == "tiny":  # subnormal products did occur, and CUDA flushed them (a margin clear of the rounding)
        if nested:
            absmax2 = cpu_state.state2.absmax.double().repeat_interleave(256)[: cpu_state.absmax.numel()]
            nested_exact = cpu_state.state2.code.double()[cpu_state.absmax.long()] * absmax2
            assert ((nested_exact != 0) & (nested_exact.abs() < FLT_MIN / 2)).any()
            scale = F.dequantize_blockwise(state.absmax, state.state2).cpu().double() + state.offset.item()
        else:
            scale = cpu_state.absmax.double()
        exact = cuda_code(quant_type)[nibbles(packed_cpu, n).long()] * scale.repeat_interleave(blocksize)[:n]
        subnormal = (exact != 0) & (exact.abs() < FLT_MIN / 2)
        assert subnormal.any() and (truths[torch.float32].view(-1)[subnormal] == 0).all()
    if kind == "small":
        fp16 = truths[torch.float16].view(-1)
        assert ((fp16 != 0) & (fp16.abs() < 2.0**-14)).any()  # fp16 subnormals, rounded as CUDA does


@pytest.mark.gpu  # bitsandbytes' CUDA kernels are the truth
def test_gpu_rounding_windows_below_flt_min():
    for quant_type in ("nf4", "fp4"):
        packed, state = window_state(quant_type, seed=101)
        for dtype in OUT_DTYPES:
            truth = _cuda_truth(packed, _to_cuda(state), dtype)
            assert _mismatches(reference.dequantize_4bit(packed, state, dtype=dtype, device="cpu"), truth) == 0
    for offset in (0.0, 2.0**-140, -3e-38):
        packed, state = nested_window_state(offset, seed=102)
        for dtype in OUT_DTYPES:
            truth = _cuda_truth(packed, _to_cuda(state), dtype)
            assert _mismatches(reference.dequantize_4bit(packed, state, dtype=dtype, device="cpu"), truth) == 0


@pytest.mark.gpu  # bitsandbytes' CUDA kernels are the truth
def test_gpu_large_weight_in_chunks():
    # bigger than a CPU chunk many times over, with a last chunk of fewer blocks
    weight = torch.randn(4096, 11008 + 64, generator=torch.Generator().manual_seed(5)) * 0.02
    packed, state = F.quantize_4bit(weight.cuda(), blocksize=64, quant_type="nf4", compress_statistics=True)
    truth = _cuda_truth(packed, state, torch.bfloat16)
    got = reference.dequantize_4bit(packed.cpu(), _cpu_state(state), dtype=torch.bfloat16, device="cpu")
    assert _mismatches(got, truth) == 0


@pytest.mark.gpu  # bitsandbytes' CUDA kernels are the truth
@pytest.mark.parametrize("nested", [False, True])
def test_gpu_non_finite_scales_give_cudas_nan_bits(nested):
    # A NaN or infinite scale (a quant state given to the API: checkpoints with one are refused) makes NaNs (inf times
    # the zero code too). bitsandbytes' CUDA kernels give their canonical NaN; the reference and our CPU path give
    # the same bits, the kernel too (the CPU's own NaN bits would differ).
    import nf4convert

    weight = torch.randn(64, 512, generator=torch.Generator().manual_seed(21))
    packed, state = F.quantize_4bit(weight.cuda(), blocksize=64, quant_type="nf4", compress_statistics=nested)
    if nested:
        state.state2.absmax = state.state2.absmax.clone()
        state.state2.absmax[1] = float("nan")
        state.state2.absmax[0] = float("inf")
    else:
        state.absmax = state.absmax.clone()
        state.absmax[3:9:2] = torch.tensor([float("nan"), float("inf"), -float("inf")], device="cuda")
    cpu_state = _cpu_state(state)
    for dtype in OUT_DTYPES:
        truth = _cuda_truth(packed, state, dtype)
        assert truth.isnan().any()
        assert _mismatches(reference.dequantize_4bit(packed.cpu(), cpu_state, dtype=dtype, device="cpu"), truth) == 0
        cpu_state.dtype = dtype
        ours = nf4convert.dequantize_4bit(packed.cpu(), cpu_state, backend="cpu").view(truth.shape)
        assert _mismatches(ours, truth) == 0, dtype
        cuda_state = _to_cuda(cpu_state)
        assert _mismatches(nf4convert.dequantize_4bit(packed, cuda_state).cpu().view(truth.shape), truth) == 0, dtype
