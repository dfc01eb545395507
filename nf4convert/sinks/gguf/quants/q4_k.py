"""Q4_K: 256-value blocks of eight 32-value groups, 4-bit levels with a 6-bit scale and min per group
(``quantize_row_q4_K_ref``, ``quantize_row_q4_K_impl`` with an importance matrix). Block: fp16 d, fp16 dmin,
12 scale bytes, 128 bytes of nibbles (values l and l + 32 of each 64 in one byte)."""

from __future__ import annotations

import numpy as np

from .arith import half_bytes
from .base import QUANTS, QuantType
from .k_scale_min import scale_min_blocks
from .xp import namespace


@QUANTS.register
class Q4_K(QuantType):
    name = "Q4_K"
    type_id = 12
    block_size = 256
    type_size = 144
    chunk_blocks = 256

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square):
        d, dmin, scales, levels = scale_min_blocks(blocks, weights, 15, (-1.0, 0.1, 20), clamp_levels=False)
        out = namespace(blocks).empty((blocks.shape[0], cls.type_size), np.uint8, blocks)
        out[:, 0:2] = half_bytes(d)
        out[:, 2:4] = half_bytes(dmin)
        out[:, 4:16] = scales
        halves = levels.reshape(-1, 4, 2, 32)
        out[:, 16:] = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(-1, 128)
        return out
