"""Q4_0: 32-value blocks, ``d = max / -8`` (max the value of largest magnitude) and 4-bit levels
(``quantize_row_q4_0_ref``; with an importance matrix ``make_qx_quants`` weighted by it and the row's mean square).
Block: fp16 d, 16 bytes of nibbles."""

from __future__ import annotations

import numpy as np

from .arith import (
    F32,
    fp16_bits,
    half_bytes,
    make_qx_quants,
    pack_nibbles,
    signed_absmax,
    to_int8,
    to_uint8,
    trunc_to_int,
    weighted_by_row,
)
from .base import QUANTS, QuantType
from .xp import namespace


def scaled_levels(x, d, offset, top):
    """The legacy reference's ``MIN(top, (int8_t)(x * id + offset))`` as the byte C stores: (32, B)."""
    xp = namespace(x)
    inverse = xp.where(d != 0, xp.div(F32(1), d), F32(0))
    return to_uint8(xp.cap(to_int8(trunc_to_int(x * inverse + F32(offset))), top))


@QUANTS.register
class Q4_0(QuantType):
    name = "Q4_0"
    type_id = 2
    block_size = 32
    type_size = 18
    uses_row_mean_square = True

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square):
        xp = namespace(blocks)
        x = xp.contiguous(blocks.T)
        if weights is None:
            d = xp.div(signed_absmax(x)[0], F32(-8))
            levels = scaled_levels(x, d, 8.5, 15)
        else:
            d, levels = make_qx_quants(x, 8, weighted_by_row(weights, mean_square, x))
        out = xp.empty((blocks.shape[0], cls.type_size), np.uint8, blocks)
        out[:, :2] = half_bytes(fp16_bits(d))
        out[:, 2:] = pack_nibbles(xp.contiguous(levels.T))
        return out
