"""IQ4_XS: IQ4_NL's levels in 256-value blocks of eight 32-value groups, each group's scale a 6-bit multiple of the
block's fp16 d (``quantize_row_iq4_nl_impl`` with super-blocks, ``ntry = 7``, as ``quantize_iq4_xs`` calls it).
Block: fp16 d, uint16 of the scales' top bit pairs, 4 bytes of their low nibbles, 128 bytes of nibbles."""

from __future__ import annotations

import numpy as np

from .arith import (
    F32,
    block_sum_squares,
    fp16_bits,
    from_groups,
    half_bytes,
    nearest_int,
    pack_nibbles,
    signed_absmax,
    to_groups,
)
from .base import QUANTS, QuantType
from .iq4_nl import group_scales, nearest_levels
from .xp import namespace

GROUPS = 8  # of 32 values in a 256-value block


@QUANTS.register
class IQ4_XS(QuantType):
    name = "IQ4_XS"
    type_id = 23
    block_size = 256
    type_size = 136
    chunk_blocks = 256

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square):
        xp = namespace(blocks)
        count = blocks.shape[0]
        x = to_groups(blocks, 32)
        sigma2 = block_sum_squares(x, count) * (F32(2) / F32(256))
        scales = group_scales(x, None if weights is None else to_groups(weights, 32), xp.tile(sigma2, GROUPS))
        max_scale = signed_absmax(scales.reshape(GROUPS, count))[0]
        d = xp.div(-max_scale, F32(32))
        inverse = xp.where(d != 0, xp.div(F32(1), d), F32(0))
        scale_levels = xp.clip(nearest_int(inverse * scales.reshape(GROUPS, count)), -32, 31)
        group_d = (d * xp.astype(scale_levels, F32)).reshape(-1)
        group_inverse = xp.where(group_d != 0, xp.div(F32(1), group_d), F32(0))
        levels = from_groups(nearest_levels(group_inverse * x), count)

        scale_levels = scale_levels + 32
        low = scale_levels & 0xF
        scales_l = (low[0::2] | (low[1::2] << 4)).T
        scales_h = xp.zeros(count, np.int64, blocks)
        for ib in range(GROUPS):
            scales_h |= xp.astype(scale_levels[ib] >> 4, np.int64) << (2 * ib)
        out = xp.empty((count, cls.type_size), np.uint8, blocks)
        out[:, :2] = half_bytes(fp16_bits(d))
        out[:, 2:4] = half_bytes(scales_h)
        out[:, 4:8] = scales_l
        out[:, 8:] = pack_nibbles(levels)
        return out
