"""The GGUF quantizers on torch tensors (the GPU route's): the same bytes as on numpy arrays, which
tests/test_gguf_quants.py ties to llama.cpp's own quantizer, for every type with and without an importance matrix.
On CUDA (``gpu``) that tests the device's arithmetic too: each torch operation one IEEE float32 operation, correctly
rounded division and square root, subnormals kept; the primitives are checked against numpy bit for bit first. On
the CPU the same comparison checks the torch path's logic (dtypes, indexing, chunking) where CI runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nf4convert.sinks.gguf.quants import QUANTS, quant_type
from nf4convert.sinks.gguf.quants.arith import seqsum
from nf4convert.sinks.gguf.quants.xp import TORCH
from tests.test_gguf_quants import _bf16, _edge_blocks, _f16, _imatrix

TYPES = sorted(QUANTS.discovered())
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


def _same_bytes(kind, rows, imatrix, device):
    """The numpy path's bytes and the torch path's on ``device``, block for block."""
    ours = kind.quantize(torch.from_numpy(rows).to(device), None if imatrix is None else torch.from_numpy(imatrix))
    assert isinstance(ours, torch.Tensor) and ours.device.type == device and ours.dtype == torch.uint8
    expected = kind.quantize(rows, imatrix)
    assert tuple(ours.shape) == expected.shape
    differ = (ours.cpu().numpy() != expected).reshape(-1, kind.type_size).any(axis=1)
    bad = np.flatnonzero(differ)
    assert not bad.size, f"{kind.name} on {device}: {bad.size} of {differ.size} blocks differ, first {bad[0]}"


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("name", TYPES)
def test_random_and_edge_rows_match_numpy(name, weighted, device):
    kind = quant_type(name)
    rng = np.random.default_rng([50, kind.type_id, weighted])
    per_row = max(1, 1024 // kind.block_size)
    rows = _f16(_edge_blocks(rng, kind.block_size, 8 * per_row).reshape(8, -1))
    _same_bytes(kind, rows, _imatrix(rng, rows.shape[1]) if weighted else None, device)
    n_rows, n_per_row = int(rng.integers(1, 6)), kind.block_size * int(rng.integers(1, max(2, 2048 // kind.block_size)))
    rows = _bf16(rng.standard_normal((n_rows, n_per_row)) * rng.uniform(1e-3, 3, (n_rows, 1)))
    _same_bytes(kind, rows, _imatrix(rng, n_per_row) if weighted else None, device)


@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("name", TYPES)
def test_shapes_roundings_and_non_finite_values_match_numpy_on_cuda(name, weighted):
    kind = quant_type(name)
    rng = np.random.default_rng([51, kind.type_id, weighted])
    for rounding, n_rows, n_per_row in ((_f16, 1, 256), (_bf16, 37, 4096), (np.float32, 5, 14336)):
        rows = rounding(rng.standard_normal((n_rows, n_per_row)) * rng.uniform(1e-3, 3, (n_rows, 1)))
        _same_bytes(kind, rows.astype(np.float32), _imatrix(rng, n_per_row) if weighted else None, "cuda")
    rows = rng.standard_normal((10, 1024)).astype(np.float32)
    rows[0, rng.integers(1024)] = np.nan
    rows[1, rng.integers(1024)] = np.inf
    rows[2, rng.integers(1024)] = -np.inf
    rows[3, :: int(rng.integers(3, 9))] = np.nan
    rows[4, rng.integers(1024)] = 3e38
    rows[5, rng.integers(1024)] = -3e38
    rows[6] = rng.standard_normal(1024) * 1e-38
    rows[7, 400:460] = rng.standard_normal(60) * 1e-42
    rows[8] = -np.abs(rows[8])
    rows[9] = 0
    _same_bytes(kind, rows, _imatrix(rng, 1024) if weighted else None, "cuda")


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_bf16_tensors_chunk_seams_and_numpy_imatrix(device, monkeypatch):
    """A bf16 tensor quantizes as its values in float32; rows cut into several device chunks (mid-row) keep each
    block's row weights and mean square; a numpy importance matrix goes where the rows are."""
    rng = np.random.default_rng(52)
    for name in ("Q4_K", "Q6_K", "Q4_0", "IQ4_XS"):
        kind = quant_type(name)
        monkeypatch.setattr(kind, "device_chunk_values", 3 * kind.block_size)
        values = torch.from_numpy(rng.standard_normal((7, 1024)).astype(np.float32)).to(torch.bfloat16).to(device)
        imatrix = _imatrix(rng, 1024)
        ours = kind.quantize(values, imatrix)
        assert ours.device.type == device
        expected = kind.quantize(values.float().cpu().numpy(), imatrix)
        assert np.array_equal(ours.cpu().numpy(), expected), name


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q3_K", "IQ4_XS"])
def test_sums_as_one_kernel_or_one_operation_an_element_give_the_same_bytes(name, monkeypatch):
    kind = quant_type(name)
    rng = np.random.default_rng([54, kind.type_id])
    rows = _bf16(rng.standard_normal((16, 2048)) * 0.02)
    imatrix = _imatrix(rng, 2048)
    monkeypatch.setattr(TORCH, "cuda_sums", False)
    _same_bytes(kind, rows, imatrix, "cuda")
    _same_bytes(kind, rows, None, "cuda")


def test_bad_shapes_are_refused_for_tensors_too():
    kind = quant_type("q4_k")
    with pytest.raises(ValueError, match="multiple of 256"):
        kind.quantize(torch.ones(2, 100))
    with pytest.raises(ValueError, match="importance matrix"):
        kind.quantize(torch.ones(2, 256), torch.ones(128))


def _every_kind_of_float(rng, count):
    """float32 bit patterns: random (normals, subnormals, infinities, NaNs), plus subnormals, zeros and values near
    float32's ends on purpose."""
    bits = rng.integers(0, 1 << 32, count, dtype=np.uint64).astype(np.uint32)
    bits[: count // 4] &= 0x807FFFFF  # subnormals and signed zeros
    values = bits.view(np.float32).copy()
    values[count // 4 : count // 2] = rng.standard_normal(count // 4).astype(np.float32)
    values[:8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -1e-45, 1.2e-38]
    return values


def _same_floats(a, b):
    a, b = np.asarray(a), np.asarray(b)
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(both_nan | (a.view(np.uint32) == b.view(np.uint32))))


@pytest.mark.gpu
def test_cuda_elementwise_arithmetic_is_ieee_float32_like_numpy(monkeypatch):
    """What the shared code relies on, on this GPU: +, -, *, / of two tensors, ``xp.div`` with a scalar side,
    sqrt, the fp16 conversion, floor and trunc, the in-order sums (one kernel each or one operation an element), bit
    for bit numpy's (NaNs as NaNs) on every kind of float."""
    rng = np.random.default_rng(53)
    a, b = _every_kind_of_float(rng, 1 << 20), _every_kind_of_float(rng, 1 << 20)[::-1].copy()
    ta, tb = torch.from_numpy(a).cuda(), torch.from_numpy(b).cuda()
    with np.errstate(all="ignore"):
        pairs = {
            "add": (a + b, ta + tb),
            "sub": (a - b, ta - tb),
            "mul": (a * b, ta * tb),
            "div": (a / b, ta / tb),
            "div by scalar": (a / np.float32(63), TORCH.div(ta, np.float32(63))),
            "scalar by tensor": (np.float32(-127) / b, TORCH.div(np.float32(-127), tb)),
            "sqrt": (np.sqrt(np.abs(a)), torch.sqrt(ta.abs())),
            "floor": (np.floor(a), torch.floor(ta)),
            "trunc": (np.trunc(a), torch.trunc(ta)),
        }
        for what, (expected, got) in pairs.items():
            assert _same_floats(expected, got.cpu().numpy()), what
        terms, times = a.reshape(32, -1), b.reshape(32, -1)
        for fused in (True, False):
            monkeypatch.setattr(TORCH, "cuda_sums", fused)
            for got, expected in (
                (seqsum(ta.reshape(32, -1), tb.reshape(32, -1)), seqsum(terms, times)),
                (seqsum(ta.reshape(32, -1)), seqsum(terms)),
            ):
                assert _same_floats(expected, got.cpu().numpy()), f"in-order sums, one kernel: {fused}"
        finite = ~np.isnan(a)
        half = a.astype(np.float16).view(np.uint16)[finite]
        assert np.array_equal(half, TORCH.half_bits(ta).cpu().numpy()[finite]), "fp16"
