"""The arithmetic ggml-quants.c's quantizers share, in numpy, to the bit: ``nearest_int``, ggml's fp16 conversion, and
the scale searches ``make_qx_quants``, ``make_q3_quants``, ``make_qkx2_quants`` / ``make_qkx3_quants`` and
``make_qp_quants``.

Every function works on many groups at once: an array ``(n, G)`` holds G groups of n values, one group per column,
so that ``x[i]`` is element i of every group (contiguous). Each is C's loop body applied to all groups at once: float32
throughout, one IEEE operation at a time (numpy neither fuses a multiply-add nor reassociates), every sum taken
element by element in C's order (``seqsum``, never numpy's pairwise reduction), C's strict comparisons and ties kept
with ``np.where``. A group that leaves a C loop early is one whose state the remaining iterations would not change,
so running them for it changes nothing. Intermediate infinities and NaNs of groups C would have skipped are masked
afterwards; callers run under ``np.errstate(all="ignore")``.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)
_ROUNDING_BIAS = F32(12582912.0)  # 1.5 * 2**23: adding it leaves round-half-even(v) in the low mantissa bits


def nearest_int(values):
    """ggml's ``nearest_int``: the bits of ``v + 1.5 * 2**23``, low 23 minus 2**22, as int32. Round half to even
    for |v| < 2**22; for other values (C only asserts in debug builds) the same bit pattern C computes."""
    bits = (values + _ROUNDING_BIAS).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def fp16_bits(values):
    """``GGML_FP32_TO_FP16`` (ggml's software conversion, as built for x86-64 without F16C): round to nearest even,
    subnormals kept, overflow to infinity, every NaN as 0x7E00 with its sign. numpy's conversion agrees on every
    non-NaN value."""
    values = np.asarray(values, dtype=F32)
    bits = values.astype(np.float16).view(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        bits = np.where(nan, ((values.view(np.uint32) >> 16) & 0x8000).astype(np.uint16) | 0x7E00, bits)
    return bits.astype(np.uint16)


def from_fp16(bits):
    """``GGML_FP16_TO_FP32``: exact."""
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(F32)


def as_f32(ints):
    return ints.astype(F32)


def seqsum(terms, start=None):
    """``float s = 0; for (i...) s += terms[i];`` for every column of ``terms`` (n, G), in that order."""
    total = np.zeros(terms.shape[1:], dtype=F32) if start is None else start.astype(F32, copy=True)
    for term in terms:
        total += term
    return total


def signed_absmax(x):
    """``if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }`` from zero: (max, amax), first of ties."""
    largest = np.zeros(x.shape[1:], dtype=F32)
    amax = np.zeros(x.shape[1:], dtype=F32)
    for value in x:
        magnitude = np.abs(value)
        bigger = magnitude > amax
        amax = np.where(bigger, magnitude, amax)
        largest = np.where(bigger, value, largest)
    return largest, amax


def running_max(x, start=0.0):
    """``if (x[i] > m) m = x[i];`` from ``start``, over the first axis."""
    best = np.full(x.shape[1:], start, dtype=F32)
    for value in x:
        best = np.where(value > best, value, best)
    return best


def signed_max_by_magnitude(x):
    """``if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }`` from zero: max only."""
    return signed_absmax(x)[0]


def trunc_to_int(values):
    """C's float-to-int conversion on x86-64 (``cvttss2si``): toward zero; NaN and out-of-range give INT_MIN."""
    inside = np.abs(values) < F32(2147483648.0)
    return np.where(inside, np.trunc(np.where(inside, values, 0)), -2147483648).astype(np.int64).astype(np.int32)


def to_int8(ints):
    """A C store into ``int8_t``: the low byte, read back signed."""
    return (np.asarray(ints).astype(np.int64) & 0xFF).astype(np.uint8).view(np.int8).astype(np.int32)


def to_uint8(ints):
    """A C store into ``uint8_t``: the low byte."""
    return (np.asarray(ints).astype(np.int64) & 0xFF).astype(np.int32)


def make_qx_quants(x, nmax, weights=None):
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)``: (scale, L in [0, 2 nmax)). Without ``weights`` the weights
    are ``x * x``."""
    largest, amax = signed_absmax(x)
    zero = amax < GROUP_MAX_EPS
    w = x * x if weights is None else weights
    wx = w * x

    def attempt(iscale):
        q = np.clip(nearest_int(iscale * x), -nmax, nmax - 1)
        lf = as_f32(q)
        return q, seqsum(wx * lf), seqsum((w * lf) * lf)

    q, sumlx, suml2 = attempt(F32(-nmax) / largest)
    levels = q + nmax
    scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        q, sumlx, suml2 = attempt(-(F32(nmax) + F32(0.1) * F32(step)) / largest)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels = np.where(better, q + nmax, levels)
        scale = np.where(better, sumlx / suml2, scale)
        best = np.where(better, scale * sumlx, best)
    return np.where(zero, F32(0), scale), np.where(zero, 0, levels)


def make_q3_quants(x, nmax):
    """``make_q3_quants(n, nmax, x, L, do_rmse=true)``: (scale, L in [0, 2 nmax))."""
    largest, amax = signed_absmax(x)
    zero = amax < GROUP_MAX_EPS
    q = np.clip(nearest_int((F32(-nmax) / largest) * x), -nmax, nmax - 1)
    w = x * x
    wx = w * x
    lf = as_f32(q)
    sumlx, suml2 = seqsum(wx * lf), seqsum((w * lf) * lf)
    for _ in range(5):
        changed = np.zeros(x.shape[1:], dtype=bool)
        for i in range(x.shape[0]):
            li = as_f32(q[i])
            slx = sumlx - wx[i] * li
            sl2 = suml2 - (w[i] * li) * li
            new_l = np.clip(nearest_int((x[i] * sl2) / slx), -nmax, nmax - 1)
            new_f = as_f32(new_l)
            slx_new = slx + wx[i] * new_f
            sl2_new = sl2 + (w[i] * new_f) * new_f
            accept = (slx > 0) & (new_l != q[i]) & (sl2_new > 0)
            accept &= (slx_new * slx_new) * suml2 > (sumlx * sumlx) * sl2_new
            q[i] = np.where(accept, new_l, q[i])
            sumlx = np.where(accept, slx_new, sumlx)
            suml2 = np.where(accept, sl2_new, suml2)
            changed |= accept
        if not changed.any():
            break
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    return np.where(zero, F32(0), scale), np.where(zero, 0, q + nmax)


def make_qkx_quants(x, weights, nmax, rmin, rdelta, nstep, use_mad):
    """``make_qkx2_quants`` and ``make_qkx3_quants`` (the same search; qkx3's ``max <= min`` test and qkx2's
    ``max == min`` agree once the min is clamped to at most 0): (scale, the_min, L in [0, nmax]). qkx3 without
    weights is this with ``weights = x * x``."""
    low, high = x[0].copy(), x[0].copy()
    sum_w = weights[0].copy()
    sum_x = sum_w * x[0]
    for i in range(1, x.shape[0]):
        low = np.where(x[i] < low, x[i], low)
        high = np.where(x[i] > high, x[i], high)
        sum_w += weights[i]
        sum_x += weights[i] * x[i]
    data_min = low
    low = np.where(low > 0, F32(0), low)
    flat = high == low
    flat_min = low

    def levels_at(iscale, low):
        """The clamped levels as float32. Where every scaled value is provably below 2**21 in magnitude (the
        groups' spans bound it), ``(v + 1.5 * 2**23) - 1.5 * 2**23`` is nearest_int(v) exactly, in two operations;
        otherwise nearest_int itself."""
        reach = np.abs(iscale) * np.maximum(np.abs(high - low), np.abs(low - data_min))
        scaled = iscale * (x - low)
        if bool(np.all(reach < F32(2**21))):
            return np.clip((scaled + _ROUNDING_BIAS) - _ROUNDING_BIAS, F32(0), F32(nmax))
        return as_f32(np.clip(nearest_int(scaled), 0, nmax))

    def error(scale, low, lf):
        diff = (scale * lf + low) - x
        diff = np.abs(diff) if use_mad else diff * diff
        return seqsum(weights * diff)

    iscale = F32(nmax) / (high - low)
    scale = F32(1) / iscale
    levels = levels_at(iscale, low)
    best = error(scale, low, levels)
    for step in range(nstep + 1):
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (high - low)
        lf = levels_at(iscale, low)
        wl = weights * lf
        sum_l, sum_l2, sum_xl = seqsum(wl), seqsum(wl * lf), seqsum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        clamped = this_min > 0
        this_min = np.where(clamped, F32(0), this_min)
        this_scale = np.where(clamped, sum_xl / sum_l2, this_scale)
        current = error(this_scale, this_min, lf)
        better = (det > 0) & (current < best)
        levels = np.where(better, lf, levels)
        best = np.where(better, current, best)
        scale = np.where(better, this_scale, scale)
        low = np.where(better, this_min, low)
    levels = levels.astype(np.int32)
    return np.where(flat, F32(0), scale), np.where(flat, -flat_min, -low), np.where(flat, 0, levels)


def make_qp_quants(x, nmax, weights):
    """``make_qp_quants(n, nmax, x, L, quant_weights)``: (scale, L as the uint8 values C leaves)."""
    largest = np.zeros(x.shape[1:], dtype=F32)
    for value in x:
        largest = np.where(largest > value, largest, value)  # MAX(max, x[i])
    zero = largest < GROUP_MAX_EPS
    wx = weights * x

    def mse(scale, q):
        diff = x - scale * as_f32(q)
        return seqsum((weights * diff) * diff)

    iscale = F32(nmax) / largest
    best = mse(F32(1) / iscale, to_uint8(nearest_int(iscale * x)))
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_step = (F32(0.1) * F32(step) + F32(nmax)) / largest
        current = mse(F32(1) / iscale_step, np.minimum(nmax, nearest_int(iscale_step * x)))
        better = current < best
        best = np.where(better, current, best)
        iscale = np.where(better, iscale_step, iscale)
    q = np.minimum(nmax, nearest_int(iscale * x))
    levels = to_uint8(q)
    lf = as_f32(q)
    sumlx, suml2 = seqsum(wx * lf), seqsum((weights * lf) * lf)
    for _ in range(5):
        changed = np.zeros(x.shape[1:], dtype=bool)
        for i in range(x.shape[0]):
            li = as_f32(levels[i])
            slx = sumlx - wx[i] * li
            sl2 = suml2 - (weights[i] * li) * li
            new_l = np.minimum(nmax, nearest_int((x[i] * sl2) / slx))
            new_f = as_f32(new_l)
            slx_new = slx + wx[i] * new_f
            sl2_new = sl2 + (weights[i] * new_f) * new_f
            accept = (slx > 0) & (sl2 > 0) & (new_l != levels[i])
            accept &= (slx_new * slx_new) * suml2 > (sumlx * sumlx) * sl2_new
            levels[i] = np.where(accept, to_uint8(new_l), levels[i])
            sumlx = np.where(accept, slx_new, sumlx)
            suml2 = np.where(accept, sl2_new, suml2)
            changed |= accept
        if not changed.any():
            break
    scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    return np.where(zero, F32(0), scale), np.where(zero, 0, levels)


def best_index_int8(table, x):
    """``best_index_int8(n, val, x)`` for a sorted table of integers: (index, table value) of the value nearest
    ``x``, ties, NaN and infinities as C's bisection resolves them. The bisection ends on the pair val[mu - 1] <= x <
    val[mu] (the first or the last pair beyond the table's ends, which the comparison then resolves as C's end tests
    do); with integer values that pair depends on floor(x) only, so it is read from a table by floor(x)."""
    first, last = int(table[0]), int(table[-1])
    values = np.asarray(table, dtype=F32)
    buckets = np.arange(first - 1, last + 2)
    lower = np.clip(np.searchsorted(np.asarray(table), buckets, side="right"), 1, len(values) - 1) - 1
    bucket = np.fmax(np.fmin(x, F32(last + 1)), F32(first - 1))  # fmin first: NaN goes to the top pair
    bucket = np.floor(bucket).astype(np.intp) - (first - 1)
    below, above = np.take(values[lower], bucket), np.take(values[lower + 1], bucket)
    nearer_below = x - below < above - x
    return np.take(lower, bucket) + ~nearer_below, np.where(nearer_below, below, above)


def to_groups(blocks, size):
    """Blocks (B, block) as groups of ``size`` values, one per column, group j of block b at column ``j * B + b``:
    (size, block / size * B)."""
    count = blocks.shape[0]
    return np.ascontiguousarray(blocks.reshape(count, -1, size).transpose(2, 1, 0)).reshape(size, -1)


def from_groups(levels, count):
    """The inverse of ``to_groups`` for the levels: (B, block)."""
    size = levels.shape[0]
    return np.ascontiguousarray(levels.reshape(size, -1, count).transpose(2, 1, 0)).reshape(count, -1)


def block_sum_squares(groups, count):
    """``for (l = 0; l < block; ++l) s += x[l] * x[l];`` per block, from groups laid out by ``to_groups``."""
    squares = (groups * groups).reshape(groups.shape[0], -1, count)
    total = np.zeros(count, dtype=F32)
    for j in range(squares.shape[1]):
        for element in squares[:, j]:
            total += element
    return total


def row_mean_squares(rows):
    """``sum_x2 / n_per_row`` per row, the sum in C's order: (n_rows,)."""
    total = np.zeros(rows.shape[0], dtype=F32)
    for column in np.ascontiguousarray(rows.T):
        total += column * column
    return total / F32(rows.shape[1])


def half_bytes(bits):
    """fp16 bit patterns (B,) as the two little-endian bytes C stores: (B, 2) uint8."""
    return np.ascontiguousarray(bits, dtype="<u2").view(np.uint8).reshape(-1, 2)


def pack_2bit(levels):
    """The K types' 2-bit plane: byte ``j / 4 + l`` of each 128 values holds levels ``j + l + 32 k`` at bits 2k."""
    quads = levels.reshape(levels.shape[0], -1, 4, 32)
    return (quads[:, :, 0] | (quads[:, :, 1] << 2) | (quads[:, :, 2] << 4) | (quads[:, :, 3] << 6)).reshape(
        levels.shape[0], -1
    )


def roundf(values):
    """C's ``roundf``: to the nearest integer, halves away from zero (the fraction ``v - trunc(v)`` is exact)."""
    whole = np.trunc(values)
    return whole + np.where(np.abs(values - whole) >= F32(0.5), np.sign(values), F32(0))


def pack_nibbles(levels):
    """The 32-value blocks' 4-bit packing: byte j holds value j (low) and value j + 16 (high), per 32: (B, n / 2)."""
    pairs = levels.reshape(levels.shape[0], -1, 2, 16)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(levels.shape[0], -1)


def fifth_bits(levels):
    """Q5_0 / Q5_1's ``qh``: bit j of a little-endian uint32 is bit 4 of value j: (B, 4) bytes."""
    bits = ((levels >> 4) & 1).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return np.bitwise_or.reduce(bits, axis=1).astype("<u4").view(np.uint8).reshape(-1, 4)


def min_max(x):
    """``min = FLT_MAX; max = -FLT_MAX; if (v < min) min = v; if (v > max) max = v;``: (min, max)."""
    low = np.full(x.shape[1:], np.finfo(F32).max, dtype=F32)
    high = np.full(x.shape[1:], -np.finfo(F32).max, dtype=F32)
    for value in x:
        low = np.where(value < low, value, low)
        high = np.where(value > high, value, high)
    return low, high


def weighted_by_row(weights, mean_square, x):
    """The legacy types' importance weights: ``qw[j] * sqrtf(sigma2 + x[j] * x[j])`` with sigma2 the row's mean
    square, for groups of one block each (x (32, B), weights (B, 32), mean_square (B,))."""
    return np.ascontiguousarray(weights.T) * np.sqrt(mean_square + x * x)
