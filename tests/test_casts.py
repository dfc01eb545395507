"""The converter's casts of plain tensors (kernels/cpu.cast, numpy): torch's CPU casts for every number, CUDA's
canonical NaN for every NaN. Random bit patterns of each source dtype (every exponent: subnormals, overflow to inf,
ties) and the edge values, against torch's Tensor.to as the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nf4convert.dtypes import DTYPES
from nf4convert.kernels import cpu

SOURCES = ("F64", "F32", "F16", "BF16")
TARGETS = ("F32", "F16", "BF16")
INTEGER = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _random_bits(code: str, count: int, seed: int) -> torch.Tensor:
    itemsize = DTYPES[code].itemsize
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, count * itemsize, dtype=np.uint8)
    edges = {
        "F64": [
            1.0,
            -0.0,
            65504.0,
            65520.0,
            3.4028235677973366e38,
            3.4028235677973366e38 * 1.0000001,
            1e-45,
            2.0**-149 * 0.5,
        ],
        "F32": [1.0, -0.0, 65504.0, 65519.99, 65520.0, 3.4028234e38, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 1e-40],
        "F16": [1.0, -0.0, 65504.0, 6e-8],
        "BF16": [1.0, -0.0, 3.3e38, 1e-40],
    }[code]
    values = torch.from_numpy(raw).view(DTYPES[code].torch).clone()
    values[: len(edges)] = torch.tensor(edges, dtype=torch.float64).to(DTYPES[code].torch)
    values[len(edges) : len(edges) + 3] = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=values.dtype)
    return values


# numpy's integer rounding where torch is not imported (the CPU route without it), torch's own cast where it is (fp16
# always: numpy converts to it one element at a time)
CASES = [
    (s, t, path)
    for s in SOURCES
    for t in TARGETS
    if s != t
    for path in ("numpy", "torch")
    if path == "torch" or t != "F16"
]


@pytest.mark.parametrize("source,target,path", CASES)
def test_casts_are_torchs_with_canonical_nans(source, target, path, monkeypatch):
    monkeypatch.setattr(cpu, "_torch_loaded", lambda: path == "torch")
    values = _random_bits(source, 200_003, seed=SOURCES.index(source) * 7 + TARGETS.index(target))
    expected = values.to(DTYPES[target].torch)
    out = np.empty(values.numel() * DTYPES[target].itemsize, dtype=np.uint8)
    cpu.cast(values.view(torch.uint8).numpy(), source, out, target)
    got = torch.from_numpy(out).view(DTYPES[target].torch)
    nan = expected.isnan()
    assert nan.sum() > 10 and torch.equal(got.isnan(), nan)
    integer = INTEGER[DTYPES[target].itemsize]
    assert torch.equal(got[~nan].view(integer), expected[~nan].view(integer))
    assert (got[nan].view(integer) == cpu.CANONICAL_NAN[target]).all()
