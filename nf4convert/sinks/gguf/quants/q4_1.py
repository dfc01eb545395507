"""Q4_1: 32-value blocks, ``d = (max - min) / 15`` and the min, 4-bit levels (``quantize_row_q4_1_ref``; with an
importance matrix ``make_qkx3_quants`` weighted by it and the row's mean square). Block: fp16 d, fp16 m, 16 bytes
of nibbles."""

from __future__ import annotations

import numpy as np

from .arith import F32, fp16_bits, half_bytes, make_qkx_quants, min_max, pack_nibbles, weighted_by_row
from .base import QUANTS, QuantType
from .q4_0 import scaled_levels
from .xp import namespace


def min_scaled(blocks, weights, mean_square, nmax):
    """(d, m, levels (B, 32)) of Q4_1 (nmax 15) and Q5_1 (nmax 31)."""
    xp = namespace(blocks)
    x = xp.contiguous(blocks.T)
    if weights is None:
        low, high = min_max(x)
        d = xp.div(high - low, F32(nmax))
        # the reference clamps Q4_1's levels at 15 and leaves Q5_1's as they fall
        levels = scaled_levels(x - low, d, 0.5, 15 if nmax == 15 else 255)
        m = low
    else:
        d, the_min, levels = make_qkx_quants(x, weighted_by_row(weights, mean_square, x), nmax, -0.9, 0.05, 36, False)
        m = -the_min
    return d, m, xp.contiguous(levels.T)


@QUANTS.register
class Q4_1(QuantType):
    name = "Q4_1"
    type_id = 3
    block_size = 32
    type_size = 20
    uses_row_mean_square = True

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square):
        d, m, levels = min_scaled(blocks, weights, mean_square, 15)
        out = namespace(blocks).empty((blocks.shape[0], cls.type_size), np.uint8, blocks)
        out[:, :2] = half_bytes(fp16_bits(d))
        out[:, 2:4] = half_bytes(fp16_bits(m))
        out[:, 4:] = pack_nibbles(levels)
        return out
