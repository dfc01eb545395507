"""Q3_K: 256-value blocks of sixteen 16-value groups, 3-bit levels with a 6-bit signed scale per group
(``quantize_row_q3_K_ref`` with ``make_q3_quants``; ``quantize_row_q3_K_impl`` with ``make_qx_quants`` and an
importance matrix). Block: 32 bytes of high bits (bit k of byte m for value 32 k + m), 64 bytes of 2-bit planes,
12 scale bytes, fp16 d."""

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
    make_q3_quants,
    make_qx_quants,
    nearest_int,
    pack_2bit,
    seqsum,
    signed_absmax,
    to_groups,
    to_int8,
)
from .base import QUANTS, QuantType
from .xp import namespace

GROUPS = 16  # of 16 values in a 256-value block


def pack_scales(levels):
    """Sixteen 6-bit scale levels (16, B): low nibbles in bytes 0-7, top bit pairs in bytes 8-11: (12, B)."""
    xp = namespace(levels)
    packed = xp.zeros((12, levels.shape[1]), np.int64, levels)
    for j in range(GROUPS):
        level = xp.astype(levels[j], np.int64)
        if j < 8:
            packed[j] = level & 0xF
        else:
            packed[j - 8] |= (level & 0xF) << 4
        packed[j % 4 + 8] |= (level >> 4) << (2 * (j // 4))
    return packed & 0xFF


def unpack_scales(packed):
    """The signed scales C reads back from the 12 bytes: (16, B)."""
    xp = namespace(packed)
    scales = xp.empty((GROUPS, packed.shape[1]), np.int64, packed)
    for j in range(GROUPS):
        low = packed[j] & 0xF if j < 8 else packed[j - 8] >> 4
        scales[j] = to_int8((low | (((packed[8 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32)
    return scales


@QUANTS.register
class Q3_K(QuantType):
    name = "Q3_K"
    type_id = 11
    block_size = 256
    type_size = 110
    chunk_blocks = 256

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square):
        xp = namespace(blocks)
        count = blocks.shape[0]
        x = to_groups(blocks, 16)
        if weights is None:
            scales, levels = make_q3_quants(x, 4)
            max_scale = signed_absmax(scales.reshape(GROUPS, count))[0]
            iscale = xp.div(F32(-32), max_scale)
            scale_levels = xp.clip(to_int8(nearest_int(iscale * scales.reshape(GROUPS, count))), -32, 31) + 32
            scale_levels = xp.where(max_scale != 0, scale_levels, 0)
            d = xp.where(max_scale != 0, fp16_bits(xp.div(F32(1), iscale)), 0)  # 0: the bits of +0.0
        else:
            sigma2 = xp.div(F32(2) * block_sum_squares(x, count), F32(256))
            w = to_groups(weights, 16) * xp.sqrt(xp.tile(sigma2, GROUPS) + x * x)
            scales, levels = make_qx_quants(x, 4, w)
            d_block, scale_levels = make_qx_quants(scales.reshape(GROUPS, count), 32, seqsum(w).reshape(GROUPS, count))
            d = fp16_bits(d_block)
        packed = pack_scales(scale_levels)
        if weights is None:
            packed = xp.where(max_scale != 0, packed, 0)
        group_d = (from_fp16(d) * as_f32(unpack_scales(packed))).reshape(-1)
        requantized = xp.clip(nearest_int(x / group_d), -4, 3) + 4
        levels = from_groups(xp.where(group_d == 0, levels, requantized), count)

        planes = levels.reshape(count, 8, 32)
        high = planes > 3
        hmask = xp.zeros((count, 32), np.int32, blocks)
        for k in range(8):
            hmask |= xp.astype(high[:, k], np.int32) << k
        levels = xp.where(high, planes - 4, planes).reshape(count, 256)
        out = xp.empty((count, cls.type_size), np.uint8, blocks)
        out[:, :32] = hmask
        out[:, 32:96] = pack_2bit(levels)
        out[:, 96:108] = packed.T
        out[:, 108:110] = half_bytes(d)
        return out
