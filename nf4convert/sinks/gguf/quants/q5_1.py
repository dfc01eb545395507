"""Q5_1: 32-value blocks, ``d = (max - min) / 31`` and the min, 5-bit levels (``quantize_row_q5_1_ref``; with an
importance matrix ``make_qkx3_quants`` weighted by it and the row's mean square). Block: fp16 d, fp16 m, 4 bytes of
fifth bits, 16 bytes of nibbles."""

from __future__ import annotations

import numpy as np

from .arith import fifth_bits, fp16_bits, half_bytes, pack_nibbles
from .base import QUANTS, QuantType
from .q4_1 import min_scaled
from .xp import namespace


@QUANTS.register
class Q5_1(QuantType):
    name = "Q5_1"
    type_id = 7
    block_size = 32
    type_size = 24
    uses_row_mean_square = True

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square):
        d, m, levels = min_scaled(blocks, weights, mean_square, 31)
        out = namespace(blocks).empty((blocks.shape[0], cls.type_size), np.uint8, blocks)
        out[:, :2] = half_bytes(fp16_bits(d))
        out[:, 2:4] = half_bytes(fp16_bits(m))
        out[:, 4:8] = fifth_bits(levels)
        out[:, 8:] = pack_nibbles(levels & 0xF)
        return out
