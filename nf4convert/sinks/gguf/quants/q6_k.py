"""Q6_K: 256-value blocks of sixteen 16-value groups, 6-bit levels with an int8 scale per group
(``quantize_row_q6_K_ref``; ``quantize_row_q6_K_impl`` with an importance matrix, which weights each group's
search by it directly). Block: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d."""

from __future__ import annotations

import numpy as np

from .arith import (
    F32,
    GROUP_MAX_EPS,
    as_f32,
    fp16_bits,
    from_fp16,
    from_groups,
    half_bytes,
    make_qx_quants,
    nearest_int,
    signed_absmax,
    to_groups,
    to_int8,
    to_uint8,
)
from .base import QUANTS, QuantType
from .xp import namespace


@QUANTS.register
class Q6_K(QuantType):
    name = "Q6_K"
    type_id = 14
    block_size = 256
    type_size = 210
    chunk_blocks = 256

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square):
        xp = namespace(blocks)
        count = blocks.shape[0]
        x = to_groups(blocks, 16)
        scales, levels = make_qx_quants(x, 32, None if weights is None else to_groups(weights, 16))
        max_scale, max_abs_scale = signed_absmax(scales.reshape(16, count))
        empty = max_abs_scale < GROUP_MAX_EPS
        iscale = xp.div(F32(-128), max_scale)
        d = fp16_bits(xp.div(F32(1), iscale))
        group_scales = to_int8(xp.cap(nearest_int(iscale * scales.reshape(16, count)), 127))
        group_d = (from_fp16(d) * as_f32(group_scales)).reshape(-1)
        requantized = xp.clip(nearest_int(x / group_d), -32, 31) + 32
        levels = from_groups(xp.where(group_d == 0, levels, requantized), count)

        quads = levels.reshape(count, 2, 4, 32)  # per 128 values: rows l, l + 32, l + 64, l + 96
        low = quads & 0xF
        ql = xp.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
        high = quads >> 4
        qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
        out = xp.empty((count, cls.type_size), np.uint8, blocks)
        out[:, :128] = ql.reshape(count, 128)
        out[:, 128:192] = qh.reshape(count, 64)
        out[:, 192:208] = to_uint8(group_scales).T
        out[:, 208:210] = half_bytes(d)
        out[empty] = 0
        return out
