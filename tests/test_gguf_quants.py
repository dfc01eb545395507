"""Our GGUF quantizers (nf4convert/sinks/gguf/quants) against llama.cpp's own ggml_quantize_chunk, built from the
pinned sdist (tests/fixtures/llama_cpp.py): the same bytes for every type, with and without an importance matrix,
on seeded random rows (f16- and bf16-rounded, as the two-step route quantizes) and on the blocks quantizers trip on."""

from __future__ import annotations

import numpy as np
import pytest

from nf4convert.sinks.gguf.quants import QUANTS, quant_type
from tests.fixtures.llama_cpp import LlamaCpp

TYPES = sorted(QUANTS.discovered())


@pytest.fixture(scope="module")
def ref():
    return LlamaCpp.ready()


def _bf16(values):
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def _f16(values):
    return values.astype(np.float16).astype(np.float32)


def _imatrix(rng, n_per_row):
    """Squared activations as an imatrix holds them, with zeros (dead channels) among them."""
    weights = (rng.standard_normal(n_per_row) ** 2 * rng.uniform(0.01, 30)).astype(np.float32)
    weights[rng.random(n_per_row) < 0.05] = 0
    return weights


def _assert_same(kind, rows, imatrix, ref):
    ours = kind.quantize(rows, imatrix)
    assert ours.dtype == np.uint8 and ours.shape == (rows.shape[0], kind.row_size(rows.shape[1]))
    theirs = ref.quantize_chunk(kind.type_id, rows, imatrix).reshape(ours.shape)
    blocks = ours.reshape(-1, kind.type_size) != theirs.reshape(-1, kind.type_size)
    bad = np.flatnonzero(blocks.any(axis=1))
    assert not bad.size, f"{kind.name}: {bad.size} of {blocks.shape[0]} blocks differ, first {bad[0]}"


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("name", TYPES)
def test_random_rows_match_llama_cpp(name, weighted, ref):
    kind = quant_type(name)
    rng = np.random.default_rng([20261207, kind.type_id, weighted])
    for rounding in (_f16, _bf16, np.float32):
        n_rows = int(rng.integers(1, 9))
        n_per_row = kind.block_size * int(rng.integers(1, max(2, 4096 // kind.block_size)))
        spread = rng.uniform(1e-3, 3, (n_rows, 1))
        rows = rounding(rng.standard_normal((n_rows, n_per_row)) * spread + rng.normal(0, 0.01, (n_rows, 1)))
        _assert_same(kind, rows, _imatrix(rng, n_per_row) if weighted else None, ref)


def _edge_blocks(rng, block, count):
    """``count`` blocks that are all zero, constant, all negative, one huge outlier, tiny values near the
    subnormals, half zeros, mostly tiny with a few large, or ordinary noise: each kind in turn, in a shuffled
    order."""
    makers = [
        lambda: np.zeros(block),
        lambda: np.full(block, rng.normal(0, 1)),
        lambda: -np.abs(rng.standard_normal(block)) * rng.uniform(0.01, 2),
        lambda: np.abs(rng.standard_normal(block)) * rng.uniform(0.01, 2),
        lambda: np.where(np.arange(block) == rng.integers(block), rng.choice([-6e4, 6e4]), rng.standard_normal(block)),
        lambda: rng.standard_normal(block) * 1e-6,
        lambda: rng.standard_normal(block) * 3e-8,
        lambda: np.where(rng.random(block) < 0.5, 0, rng.standard_normal(block)),
        lambda: rng.standard_normal(block) * np.where(rng.random(block) < 0.9, 1e-3, 1.0),
        lambda: rng.standard_normal(block),
    ]
    order = rng.permutation(count) % len(makers)
    return np.concatenate([makers[int(kind)]() for kind in order])


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("name", TYPES)
def test_edge_blocks_match_llama_cpp(name, weighted, ref):
    kind = quant_type(name)
    rng = np.random.default_rng([7, kind.type_id, weighted])
    n_rows, per_row = 12, max(1, 1024 // kind.block_size)
    rows = _f16(_edge_blocks(rng, kind.block_size, n_rows * per_row).reshape(n_rows, -1))
    imatrix = None
    if weighted:
        imatrix = _imatrix(rng, rows.shape[1])
        imatrix[: kind.block_size] = 0  # a whole block with no importance
    _assert_same(kind, rows, imatrix, ref)


def test_rows_of_the_wrong_width_are_refused():
    kind = quant_type("q4_k")
    with pytest.raises(ValueError, match="multiple of 256"):
        kind.quantize(np.ones((2, 100), dtype=np.float32))
    with pytest.raises(ValueError, match="importance matrix"):
        kind.quantize(np.ones((2, 256), dtype=np.float32), np.ones(128, dtype=np.float32))


@pytest.mark.parametrize("name", TYPES)
def test_chunk_boundaries_keep_each_blocks_row_and_weights(name, ref):
    """Rows of three blocks, more of them than one chunk holds: each block keeps its row's weights and mean square
    across the chunks' seams."""
    kind = quant_type(name)
    rng = np.random.default_rng([11, kind.type_id])
    n_rows = kind.chunk_blocks // 2 + int(rng.integers(1, 7))
    rows = _bf16(rng.standard_normal((n_rows, 3 * kind.block_size)) * rng.uniform(0.01, 2, (n_rows, 1)))
    _assert_same(kind, rows, _imatrix(rng, rows.shape[1]), ref)


def test_f16_conversion_matches_ggml_on_every_kind_of_float(ref):
    """ggml's software fp32 -> fp16 on random bit patterns: normals, subnormals, overflow, infinities, NaNs, and
    values halfway between two fp16 values."""
    rng = np.random.default_rng(16)
    bits = rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    halfway = (rng.integers(0, 1 << 16, 1 << 12, dtype=np.uint32) << 13) | 0x1000  # ties to even
    values = np.concatenate([bits, halfway, np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x477FF000])])
    rows = values.view(np.float32).reshape(1, -1)
    _assert_same(quant_type("f16"), rows, None, ref)


def _best_index_int8_c(table, x):
    """ggml-quants.c's ``best_index_int8``, line for line, on one float."""
    if x <= table[0]:
        return 0
    if x >= table[-1]:
        return len(table) - 1
    low, high = 0, len(table) - 1
    while high - low > 1:
        middle = (low + high) // 2
        if x < table[middle]:
            high = middle
        else:
            low = middle
    below, above = np.float32(x) - np.float32(table[high - 1]), np.float32(table[high]) - np.float32(x)
    return high - 1 if below < above else high


def test_nearest_table_index_resolves_ties_and_non_finite_values_as_c():
    from nf4convert.sinks.gguf.quants.arith import best_index_int8
    from nf4convert.sinks.gguf.quants.iq4_nl import KVALUES

    rng = np.random.default_rng(3)
    table = [int(v) for v in KVALUES]
    midpoints = [(a + b) / 2 for a, b in zip(table, table[1:])]
    specials = [np.nan, np.inf, -np.inf, -127, 113, -128, 114, 1e30, -1e30, -0.0, *table, *midpoints]
    x = np.concatenate([np.array(specials), rng.uniform(-140, 130, 4000)]).astype(np.float32)
    with np.errstate(all="ignore"):
        index, value = best_index_int8(KVALUES, x)
        expected = np.array([_best_index_int8_c(table, v) for v in x])
    assert np.array_equal(index, expected)
    assert np.array_equal(value, KVALUES[expected].astype(np.float32))


def test_nearest_int_is_cs_bit_trick_everywhere():
    """Round half to even where C asserts it applies, and C's bit pattern beyond (release builds skip the assert)."""
    import struct

    from nf4convert.sinks.gguf.quants.arith import nearest_int

    rng = np.random.default_rng(5)
    x = np.concatenate([np.arange(-8, 8.5, 0.5), rng.normal(0, 1e3, 2000), rng.normal(0, 1e8, 200), [np.nan, np.inf]])
    x = x.astype(np.float32)
    with np.errstate(all="ignore"):
        ours = nearest_int(x)
    for value, got in zip(x, ours, strict=True):
        (bits,) = struct.unpack("<i", struct.pack("<f", np.float32(value) + np.float32(12582912.0)))
        assert got == (bits & 0x007FFFFF) - 0x00400000
    small = np.abs(x) <= 4194303
    assert np.array_equal(ours[small], np.rint(x[small]).astype(np.int32))


def test_types_are_found_by_name_and_by_ggml_id():
    for name in TYPES:
        kind = quant_type(name.lower())
        assert kind.name == name and quant_type(kind.type_id) is kind
        assert kind.row_size(kind.block_size * 3) == 3 * kind.type_size
    with pytest.raises(KeyError, match="no GGUF quant type"):
        quant_type("q9_k")


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("name", TYPES)
def test_non_finite_and_extreme_values_match_llama_cpp(name, weighted, ref):
    """NaN, infinities, values near float32's largest and subnormals: whatever C makes of them (its float-to-int
    conversions, its NaN comparisons), the same bytes."""
    kind = quant_type(name)
    rng = np.random.default_rng([13, kind.type_id, weighted])
    rows = rng.standard_normal((8, 1024)).astype(np.float32)
    rows[0, rng.integers(1024)] = np.nan
    rows[1, rng.integers(1024)] = np.inf
    rows[2, rng.integers(1024)] = -np.inf
    rows[3, :: int(rng.integers(3, 9))] = np.nan
    rows[4, rng.integers(1024)] = 3e38
    rows[5, rng.integers(1024)] = -3e38
    rows[6] = rng.standard_normal(1024) * 1e-38
    rows[7, 400:460] = rng.standard_normal(60) * 1e-42
    _assert_same(kind, rows, _imatrix(rng, 1024) if weighted else None, ref)
