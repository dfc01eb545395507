"""The torch Q8_0 quantizer and bf16 words (kernels/q8_0.py) against gguf-py's numpy ones, bit for bit: random values
at every scale, the edge cases (zeros, -0.0, NaN, ±inf, subnormals, scales beyond fp16's range or below its
subnormals, rounding ties in the values and in the fp16 scale), chunk boundaries; every bf16 word; on the CPU and,
on the device machine, on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nf4convert.sinks.gguf.q8_0 import Q8_0, quantize_q8_0, quiet_bf16

gguf = pytest.importorskip("gguf")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def reference(values: np.ndarray) -> bytes:
    with np.errstate(all="ignore"):
        return gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType.Q8_0).tobytes()


def ours(values: torch.Tensor, device: str) -> bytes:
    edge = gguf.quants.Q8_0.quantize_blocks
    with np.errstate(all="ignore"):
        return quantize_q8_0(values.to(device), edge).cpu().numpy().tobytes()


def edge_cases(rng: np.random.Generator) -> np.ndarray:
    """Rows of 64 float32 values (two blocks each), one case a row."""
    rows = []

    def row(values):
        rows.append(np.asarray(values, dtype=np.float32).reshape(64))

    row(np.zeros(64))
    row(-np.zeros(64))
    for special in (np.nan, np.inf, -np.inf):
        values = rng.standard_normal(64)
        values[rng.integers(64)] = special
        row(values)
    row(np.full(64, 1e-40))  # subnormal values
    row(np.full(64, 1.4e-45))  # the smallest subnormal
    row(rng.standard_normal(64) * 1e-38)  # a scale whose inverse overflows
    row(np.full(64, np.finfo(np.float32).max))  # a scale beyond fp16's range
    row(rng.standard_normal(64) * 3e-6)  # scales fp16 keeps only as subnormals
    row(np.r_[127.0, np.arange(31) - 15 + 0.5, -127.0, 15.5 - np.arange(31)])  # ties: x / d = k + 0.5 exactly
    for _ in range(8):  # the scale d = max / 127 halfway between two fp16 values
        low = np.float16(rng.uniform(1e-6, 6e4))
        high = np.nextafter(low, np.float16(np.inf))
        middle = (np.float32(low) + np.float32(high)) / 2
        values = rng.uniform(-1, 1, 64) * middle * 100
        values[0] = values[32] = middle * 127
        row(values)
    return np.stack(rows)


@pytest.mark.parametrize("device", DEVICES)
def test_q8_0_equals_gguf_py(device):
    rng = np.random.default_rng(20261127)
    cases = {
        "scales": rng.standard_normal((64, 96)) * 10.0 ** rng.integers(-40, 38, (64, 1)),
        "edges": edge_cases(rng),
        "chunks": rng.standard_normal(Q8_0(device, None).chunk_values * 2 + 32 * 7),  # two whole chunks and a part
    }
    for name, values in cases.items():
        values = values.astype(np.float32)
        assert ours(torch.from_numpy(values), device) == reference(values), name
    for dtype in (torch.bfloat16, torch.float16):  # as the converter sees them: upcast exactly
        values = (torch.randn(96, 128) * 3).to(dtype)
        assert ours(values, device) == reference(values.float().numpy()), dtype


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_words_equal_gguf_py_for_every_word(device):
    words = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    expected = gguf.quants.quantize(
        words.view(torch.bfloat16).float().numpy(), gguf.GGMLQuantizationType.BF16
    ).tobytes()
    assert quiet_bf16(words.to(device)).cpu().numpy().tobytes() == expected
