"""Q5_K: Q4_K's blocks (eight 32-value groups, a 6-bit scale and min each) with 5-bit levels
(``quantize_row_q5_K_ref``, ``quantize_row_q5_K_impl`` with an importance matrix). Block: fp16 d, fp16 dmin,
12 scale bytes, 32 bytes of fifth bits (bit 2k and 2k + 1 for values l and l + 32 of the k-th 64), 128 bytes of
nibbles."""

from __future__ import annotations

import numpy as np

from .arith import half_bytes
from .base import QUANTS, QuantType
from .k_scale_min import scale_min_blocks
from .xp import namespace


@QUANTS.register
class Q5_K(QuantType):
    name = "Q5_K"
    type_id = 13
    block_size = 256
    type_size = 176
    chunk_blocks = 256

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square):
        d, dmin, scales, levels = scale_min_blocks(blocks, weights, 31, (-0.5, 0.1, 15), clamp_levels=True)
        count = blocks.shape[0]
        halves = levels.reshape(count, 4, 2, 32)  # per 64 values: l and l + 32
        high = halves >> 4
        xp = namespace(blocks)
        qh = xp.zeros((count, 32), np.int32, blocks)
        for k in range(4):
            qh |= (high[:, k, 0] << (2 * k)) | (high[:, k, 1] << (2 * k + 1))
        low = halves & 0xF
        out = xp.empty((count, cls.type_size), np.uint8, blocks)
        out[:, 0:2] = half_bytes(d)
        out[:, 2:4] = half_bytes(dmin)
        out[:, 4:16] = scales
        out[:, 16:48] = qh
        out[:, 48:] = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(count, 128)
        return out
