"""Q5_0: 32-value blocks, ``d = max / -16`` (max the value of largest magnitude) and 5-bit levels
(``quantize_row_q5_0_ref``; with an importance matrix ``make_qx_quants`` weighted by it and the row's mean square).
Block: fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles."""

from __future__ import annotations

import numpy as np

from .arith import F32, fifth_bits, fp16_bits, half_bytes, make_qx_quants, pack_nibbles, signed_absmax, weighted_by_row
from .base import QUANTS, QuantType
from .q4_0 import scaled_levels
from .xp import namespace


@QUANTS.register
class Q5_0(QuantType):
    name = "Q5_0"
    type_id = 6
    block_size = 32
    type_size = 22
    uses_row_mean_square = True

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square):
        xp = namespace(blocks)
        x = xp.contiguous(blocks.T)
        if weights is None:
            d = xp.div(signed_absmax(x)[0], F32(-16))
            levels = scaled_levels(x, d, 16.5, 31)
        else:
            d, levels = make_qx_quants(x, 16, weighted_by_row(weights, mean_square, x))
        levels = xp.contiguous(levels.T)
        out = xp.empty((blocks.shape[0], cls.type_size), np.uint8, blocks)
        out[:, :2] = half_bytes(fp16_bits(d))
        out[:, 2:6] = fifth_bits(levels)
        out[:, 6:] = pack_nibbles(levels & 0xF)
        return out
