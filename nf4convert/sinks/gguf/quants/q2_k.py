"""Q2_K: 256-value blocks of sixteen 16-value groups, 2-bit levels with a 4-bit scale and a 4-bit min per group
(``quantize_row_q2_K_ref``; ``quantize_row_q2_K_impl`` with an importance matrix). Block: 16 scale bytes (scale in
the low nibble, min in the high), 64 bytes of 2-bit planes, fp16 d, fp16 dmin."""

from __future__ import annotations

import numpy as np

from .arith import (
    F32,
    as_f32,
    block_sum_squares,
    fp16_bits,
    from_fp16,
    from_groups,
    half_bytes,
    make_qkx_quants,
    make_qp_quants,
    nearest_int,
    pack_2bit,
    running_max,
    seqsum,
    to_groups,
    to_uint8,
)
from .base import QUANTS, QuantType
from .xp import namespace

GROUPS = 16  # of 16 values in a 256-value block


@QUANTS.register
class Q2_K(QuantType):
    name = "Q2_K"
    type_id = 10
    block_size = 256
    type_size = 84
    chunk_blocks = 256

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square):
        xp = namespace(blocks)
        count = blocks.shape[0]
        x = to_groups(blocks, 16)
        zero_half = 0  # the bits of +0.0
        if weights is None:
            scales, mins, levels = make_qkx_quants(x, xp.abs(x), 3, -0.5, 0.1, 15, use_mad=True)
            scales, mins = scales.reshape(GROUPS, count), mins.reshape(GROUPS, count)
            max_scale, max_min = running_max(scales), running_max(mins)
            scale_levels = to_uint8(nearest_int(xp.div(F32(15), max_scale) * scales))
            scale_bytes = xp.where(max_scale > 0, scale_levels, 0)
            min_levels = to_uint8(scale_bytes | (nearest_int(xp.div(F32(15), max_min) * mins) << 4))
            scale_bytes = xp.where(max_min > 0, min_levels, scale_bytes)
            d = xp.where(max_scale > 0, fp16_bits(xp.div(max_scale, F32(15))), zero_half)
            dmin = xp.where(max_min > 0, fp16_bits(xp.div(max_min, F32(15))), zero_half)
        else:
            sigma2 = xp.div(block_sum_squares(x, count), F32(256))
            w = to_groups(weights, 16) * xp.sqrt(xp.tile(sigma2, GROUPS) + x * x)
            sw = seqsum(w).reshape(GROUPS, count)
            scales, mins, levels = make_qkx_quants(x, w, 3, -0.9, 0.05, 36, use_mad=False)
            d_block, scale_levels = make_qp_quants(scales.reshape(GROUPS, count), 15, sw)
            m_block, min_levels = make_qp_quants(mins.reshape(GROUPS, count), 15, sw)
            scale_bytes = to_uint8(scale_levels | (min_levels << 4))
            d, dmin = fp16_bits(d_block), fp16_bits(m_block)
        group_d = (from_fp16(d) * as_f32(scale_bytes & 0xF)).reshape(-1)
        group_dm = (from_fp16(dmin) * as_f32(scale_bytes >> 4)).reshape(-1)
        requantized = xp.clip(nearest_int((x + group_dm) / group_d), 0, 3)
        levels = from_groups(xp.where(group_d == 0, levels, requantized), count)
        out = xp.empty((count, cls.type_size), np.uint8, blocks)
        out[:, :16] = scale_bytes.T
        out[:, 16:80] = pack_2bit(levels)
        out[:, 80:82] = half_bytes(d)
        out[:, 82:84] = half_bytes(dmin)
        return out
