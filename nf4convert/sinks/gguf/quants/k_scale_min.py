"""What Q4_K and Q5_K share: eight groups of 32 values per 256-value block, each with a 6-bit scale and a 6-bit
min packed in 12 bytes (``get_scale_min_k4``), the block's fp16 ``d`` and ``dmin``, and each value's level. Without
an importance matrix the groups' searches are ``make_qkx2_quants`` (``quantize_row_q*_K_ref``), with one
``make_qkx3_quants`` and ``make_qp_quants`` for the scales (``quantize_row_q*_K_impl``)."""

from __future__ import annotations

import numpy as np

from .arith import (
    F32,
    as_f32,
    block_sum_squares,
    fp16_bits,
    from_fp16,
    from_groups,
    make_qkx_quants,
    make_qp_quants,
    nearest_int,
    running_max,
    seqsum,
    to_groups,
    to_uint8,
)
from .xp import namespace

GROUPS = 8  # of 32 values in a 256-value block


def pack_scale_min_k4(scales, mins):
    """Eight 6-bit scales and mins (8, B), as C stores them (uint8 wrap included) in 12 bytes: (12, B)."""
    xp = namespace(scales)
    packed = xp.zeros((12, scales.shape[1]), np.int64, scales)
    for j in range(GROUPS):
        ls, lm = xp.astype(scales[j], np.int64), xp.astype(mins[j], np.int64)
        if j < 4:
            packed[j] = ls & 0xFF
            packed[j + 4] = lm & 0xFF
        else:
            packed[j + 4] = ((ls & 0xF) | ((lm & 0xF) << 4)) & 0xFF
            packed[j - 4] = (packed[j - 4] | ((ls >> 4) << 6)) & 0xFF
            packed[j] = (packed[j] | ((lm >> 4) << 6)) & 0xFF
    return packed


def get_scale_min_k4(packed):
    """``get_scale_min_k4`` for j = 0..7: (scales, mins), each (8, B)."""
    xp = namespace(packed)
    scales = xp.empty((GROUPS, packed.shape[1]), np.int64, packed)
    mins = xp.empty((GROUPS, packed.shape[1]), np.int64, packed)
    for j in range(GROUPS):
        if j < 4:
            scales[j], mins[j] = packed[j] & 63, packed[j + 4] & 63
        else:
            scales[j] = (packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4)
            mins[j] = (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4)
    return scales, mins


def scale_min_blocks(blocks, weights, nmax, ref_search, clamp_levels):
    """(d bits (B,), dmin bits (B,), the 12 scale bytes (B, 12), levels (B, 256) in [0, nmax]) for 256-value
    ``blocks``. ``ref_search``: make_qkx2_quants' (rmin, rdelta, nstep) without weights; ``clamp_levels``: whether
    the weighted path clamps the scale levels to 63 before packing (Q5_K does, Q4_K does not)."""
    xp = namespace(blocks)
    count = blocks.shape[0]
    x = to_groups(blocks, 32)
    if weights is None:
        av_x = xp.sqrt(xp.div(seqsum(x, x), F32(32)))
        w = av_x + xp.abs(x)
        scales, mins, levels = make_qkx_quants(x, w, nmax, *ref_search, use_mad=False)
        scales, mins = scales.reshape(GROUPS, count), mins.reshape(GROUPS, count)
        max_scale, max_min = running_max(scales), running_max(mins)
        inv_scale = xp.where(max_scale > 0, xp.div(F32(63), max_scale), F32(0))
        inv_min = xp.where(max_min > 0, xp.div(F32(63), max_min), F32(0))
        ls = xp.cap(to_uint8(nearest_int(inv_scale * scales)), 63)
        lm = xp.cap(to_uint8(nearest_int(inv_min * mins)), 63)
        d, dmin = fp16_bits(xp.div(max_scale, F32(63))), fp16_bits(xp.div(max_min, F32(63)))
    else:
        sigma2 = xp.div(F32(2) * block_sum_squares(x, count), F32(256))
        w = to_groups(weights, 32) * xp.sqrt(xp.tile(sigma2, GROUPS) + x * x)
        sw = seqsum(w).reshape(GROUPS, count)
        scales, mins, levels = make_qkx_quants(x, w, nmax, -0.9, 0.05, 36, use_mad=False)
        d_block, ls = make_qp_quants(scales.reshape(GROUPS, count), 63, sw)
        m_block, lm = make_qp_quants(mins.reshape(GROUPS, count), 63, sw)
        if clamp_levels:
            ls, lm = xp.cap(ls, 63), xp.cap(lm, 63)
        d, dmin = fp16_bits(d_block), fp16_bits(m_block)
    packed = pack_scale_min_k4(ls, lm)
    sc, m = get_scale_min_k4(packed)
    group_d = (from_fp16(d) * as_f32(sc)).reshape(-1)
    group_dm = (from_fp16(dmin) * as_f32(m)).reshape(-1)
    requantized = xp.clip(nearest_int((x + group_dm) / group_d), 0, nmax)
    levels = xp.where(group_d == 0, levels, requantized)
    return d, dmin, xp.astype(packed.T, np.uint8), from_groups(levels, count)
