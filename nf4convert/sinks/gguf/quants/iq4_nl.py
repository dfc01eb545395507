"""IQ4_NL: 32-value blocks, each value one of sixteen non-linear levels (``kvalues_iq4nl``) times an fp16 scale
found by ``quantize_row_iq4_nl_impl``'s search (with ``ntry = 7``, as ``quantize_iq4_nl`` calls it with or without
an importance matrix). Block: fp16 d, 16 bytes of nibbles. The per-32 search is shared with IQ4_XS."""

from __future__ import annotations

import numpy as np

from .arith import (
    F32,
    GROUP_MAX_EPS,
    best_index_int8,
    fp16_bits,
    half_bytes,
    pack_nibbles,
    seqsum,
    signed_absmax,
)
from .base import QUANTS, QuantType
from .xp import namespace

KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
NTRY = 7


def nearest_levels(scaled):
    """The index of the nearest level of each scaled value."""
    return best_index_int8(KVALUES, scaled)[0]


def group_scales(x, weights, sigma2):
    """Each 32-value group's scale (G,), 0 where the group is all (near) zero. ``x``: (32, G); ``weights``: the
    importance weights (32, G) or None; ``sigma2``: the block's ``2 * sum(x^2) / block`` per group (G,)."""
    xp = namespace(x)
    w = x * x if weights is None else weights * xp.sqrt(sigma2 + x * x)
    largest, amax = signed_absmax(x)

    def sums(inverse):
        q = best_index_int8(KVALUES, inverse * x)[1]
        wq = w * q
        return seqsum(wq, x), seqsum(wq, q)

    sumqx, sumq2 = sums(xp.div(F32(1), xp.div(-largest, F32(KVALUES[0]))))
    d = xp.where(sumq2 > 0, sumqx / sumq2, F32(0))
    best = d * sumqx
    for itry in range(-NTRY, NTRY + 1):
        sumqx, sumq2 = sums(xp.div(F32(itry + int(KVALUES[0])), largest))
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = xp.where(better, sumqx / sumq2, d)
        best = xp.where(better, d * sumqx, best)
    return xp.where(amax < GROUP_MAX_EPS, F32(0), d)


@QUANTS.register
class IQ4_NL(QuantType):
    name = "IQ4_NL"
    type_id = 20
    block_size = 32
    type_size = 18

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square):
        xp = namespace(blocks)
        x = xp.contiguous(blocks.T)
        sigma2 = seqsum(x, x) * (F32(2) / F32(32))
        d = group_scales(x, None if weights is None else xp.contiguous(weights.T), sigma2)
        inverse = xp.where(d != 0, xp.div(F32(1), d), F32(0))
        levels = xp.contiguous(nearest_levels(inverse * x).T)
        out = xp.empty((blocks.shape[0], cls.type_size), np.uint8, blocks)
        out[:, :2] = half_bytes(fp16_bits(d))
        out[:, 2:] = pack_nibbles(levels)
        return out
