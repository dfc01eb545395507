"""The arithmetic ggml-quants.c's quantizers share, in numpy, to the bit: ``nearest_int``, ggml's fp16 conversion, and
the scale searches ``make_qx_quants``, ``make_q3_quants``, ``make_qkx2_quants`` / ``make_qkx3_quants`` and
``make_qp_quants``.

Every function works on many groups at once: an array ``(n, G)`` holds G groups of n values, one group per column,
so that ``x[i]`` is element i of every group (contiguous). Each is C's loop body applied to all groups at once: float32
throughout, one IEEE operation at a time (numpy neither fuses a multiply-add nor reassociates), every sum taken
element by element in C's order (``seqsum``, never numpy's pairwise reduction), C's strict comparisons and ties kept
with ``where``. A group that leaves a C loop early is one whose state the remaining iterations would not change,
so running them for it changes nothing. Intermediate infinities and NaNs of groups C would have skipped are masked
afterwards; callers run under ``xp.errstate()``.

The same code runs on numpy arrays and on torch tensors (CPU or CUDA): each function takes its operations from
``namespace`` of its input (``xp``), and every division with a scalar side is ``xp.div``.
"""

from __future__ import annotations

import numpy as np

from .xp import NUMPY, namespace

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)
_ROUNDING_BIAS = F32(12582912.0)  # 1.5 * 2**23: adding it leaves round-half-even(v) in the low mantissa bits


def nearest_int(values):
    """ggml's ``nearest_int``: the bits of ``v + 1.5 * 2**23``, low 23 minus 2**22, as int32. Round half to even
    for |v| < 2**22; for other values (C only asserts in debug builds) the same bit pattern C computes."""
    bits = namespace(values).as_int32_bits(values + _ROUNDING_BIAS)
    return (bits & 0x007FFFFF) - 0x00400000


def fp16_bits(values):
    """``GGML_FP32_TO_FP16`` (ggml's software conversion, as built for x86-64 without F16C): round to nearest even,
    subnormals kept, overflow to infinity, every NaN as 0x7E00 with its sign; as int32. numpy's and torch's
    conversions agree on every non-NaN value."""
    xp = namespace(values)
    values = xp.astype(values, F32)
    signs = xp.where(xp.as_int32_bits(values) < 0, 0x8000, 0)
    return xp.where(xp.isnan(values), signs | 0x7E00, xp.half_bits(values))


def from_fp16(bits):
    """``GGML_FP16_TO_FP32``: exact."""
    return namespace(bits).from_half_bits(bits)


def as_f32(ints):
    return namespace(ints).astype(ints, F32)


def seqsum(terms, times=None):
    """``float s = 0; for (i...) s += terms[i];`` (or ``terms[i] * times[i]``, each product rounded first) for every
    column of ``terms`` (n, G), in that order. On a CUDA GPU one kernel (``kernels/seqsum.py``)."""
    xp = namespace(terms)
    if xp.fused_sums(terms):
        from nf4convert.kernels.seqsum import seqsum_cuda

        return seqsum_cuda(terms, times)
    if times is not None:
        terms = terms * times
    total = xp.zeros(terms.shape[1:], F32, terms)
    for term in terms:
        total += term
    return total


def signed_absmax(x):
    """``if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }`` from zero: (max, amax), first of ties."""
    xp = namespace(x)
    largest = xp.zeros(x.shape[1:], F32, x)
    amax = xp.zeros(x.shape[1:], F32, x)
    for value in x:
        magnitude = xp.abs(value)
        bigger = magnitude > amax
        amax = xp.where(bigger, magnitude, amax)
        largest = xp.where(bigger, value, largest)
    return largest, amax


def running_max(x, start=0.0):
    """``if (x[i] > m) m = x[i];`` from ``start``, over the first axis."""
    xp = namespace(x)
    best = xp.full(x.shape[1:], start, F32, x)
    for value in x:
        best = xp.where(value > best, value, best)
    return best


def signed_max_by_magnitude(x):
    """``if (fabsf(x[i]) > amax) { amax = fabsf(x[i]); max = x[i]; }`` from zero: max only."""
    return signed_absmax(x)[0]


def trunc_to_int(values):
    """C's float-to-int conversion on x86-64 (``cvttss2si``): toward zero; NaN and out-of-range give INT_MIN."""
    xp = namespace(values)
    inside = xp.abs(values) < F32(2147483648.0)
    whole = xp.where(inside, xp.trunc(xp.where(inside, values, F32(0))), F32(-2147483648.0))
    return xp.astype(xp.astype(whole, np.int64), np.int32)


def to_int8(ints):
    """A C store into ``int8_t``: the low byte, read back signed."""
    return ((ints & 0xFF) ^ 0x80) - 0x80


def to_uint8(ints):
    """A C store into ``uint8_t``: the low byte."""
    return ints & 0xFF


def make_qx_quants(x, nmax, weights=None):
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)``: (scale, L in [0, 2 nmax)). Without ``weights`` the weights
    are ``x * x``."""
    xp = namespace(x)
    largest, amax = signed_absmax(x)
    zero = amax < GROUP_MAX_EPS
    w = x * x if weights is None else weights
    wx = w * x

    def attempt(iscale):
        q = xp.clip(nearest_int(iscale * x), -nmax, nmax - 1)
        lf = as_f32(q)
        return q, seqsum(wx, lf), seqsum(w * lf, lf)

    q, sumlx, suml2 = attempt(xp.div(F32(-nmax), largest))
    levels = q + nmax
    scale = xp.where(suml2 != 0, sumlx / suml2, F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        q, sumlx, suml2 = attempt(xp.div(-(F32(nmax) + F32(0.1) * F32(step)), largest))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels = xp.where(better, q + nmax, levels)
        scale = xp.where(better, sumlx / suml2, scale)
        best = xp.where(better, scale * sumlx, best)
    return xp.where(zero, F32(0), scale), xp.where(zero, 0, levels)


def make_q3_quants(x, nmax):
    """``make_q3_quants(n, nmax, x, L, do_rmse=true)``: (scale, L in [0, 2 nmax))."""
    xp = namespace(x)
    largest, amax = signed_absmax(x)
    zero = amax < GROUP_MAX_EPS
    q = xp.clip(nearest_int(xp.div(F32(-nmax), largest) * x), -nmax, nmax - 1)
    w = x * x
    wx = w * x
    lf = as_f32(q)
    sumlx, suml2 = seqsum(wx, lf), seqsum(w * lf, lf)
    for _ in range(5):
        changed = xp.zeros(x.shape[1:], bool, x)
        for i in range(x.shape[0]):
            li = as_f32(q[i])
            slx = sumlx - wx[i] * li
            sl2 = suml2 - (w[i] * li) * li
            new_l = xp.clip(nearest_int((x[i] * sl2) / slx), -nmax, nmax - 1)
            new_f = as_f32(new_l)
            slx_new = slx + wx[i] * new_f
            sl2_new = sl2 + (w[i] * new_f) * new_f
            accept = (slx > 0) & (new_l != q[i]) & (sl2_new > 0)
            accept &= (slx_new * slx_new) * suml2 > (sumlx * sumlx) * sl2_new
            q[i] = xp.where(accept, new_l, q[i])
            sumlx = xp.where(accept, slx_new, sumlx)
            suml2 = xp.where(accept, sl2_new, suml2)
            changed |= accept
        if not xp.to_bool(changed.any()):
            break
    scale = xp.where(suml2 > 0, sumlx / suml2, F32(0))
    return xp.where(zero, F32(0), scale), xp.where(zero, 0, q + nmax)


def make_qkx_quants(x, weights, nmax, rmin, rdelta, nstep, use_mad):
    """``make_qkx2_quants`` and ``make_qkx3_quants`` (the same search; qkx3's ``max <= min`` test and qkx2's
    ``max == min`` agree once the min is clamped to at most 0): (scale, the_min, L in [0, nmax]). qkx3 without
    weights is this with ``weights = x * x``."""
    xp = namespace(x)
    low, high = xp.copy(x[0]), xp.copy(x[0])
    sum_w = xp.copy(weights[0])
    sum_x = sum_w * x[0]
    for i in range(1, x.shape[0]):
        low = xp.where(x[i] < low, x[i], low)
        high = xp.where(x[i] > high, x[i], high)
        sum_w += weights[i]
        sum_x += weights[i] * x[i]
    data_min = low
    low = xp.where(low > 0, F32(0), low)
    flat = high == low
    flat_min = low

    def levels_at(iscale, low):
        """The clamped levels as float32. Where every scaled value is provably below 2**21 in magnitude (the
        groups' spans bound it), ``(v + 1.5 * 2**23) - 1.5 * 2**23`` is nearest_int(v) exactly, in two operations;
        otherwise nearest_int itself."""
        reach = xp.abs(iscale) * xp.maximum(xp.abs(high - low), xp.abs(low - data_min))
        scaled = iscale * (x - low)
        if xp.to_bool((reach < F32(2**21)).all()):
            return xp.clip((scaled + _ROUNDING_BIAS) - _ROUNDING_BIAS, F32(0), F32(nmax))
        return as_f32(xp.clip(nearest_int(scaled), 0, nmax))

    def error(scale, low, lf):
        diff = (scale * lf + low) - x
        diff = xp.abs(diff) if use_mad else diff * diff
        return seqsum(weights, diff)

    iscale = xp.div(F32(nmax), high - low)
    scale = xp.div(F32(1), iscale)
    levels = levels_at(iscale, low)
    best = error(scale, low, levels)
    for step in range(nstep + 1):
        iscale = xp.div(F32(rmin) + F32(rdelta) * F32(step) + F32(nmax), high - low)
        lf = levels_at(iscale, low)
        wl = weights * lf
        sum_l, sum_l2, sum_xl = seqsum(wl), seqsum(wl, lf), seqsum(wl, x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        clamped = this_min > 0
        this_min = xp.where(clamped, F32(0), this_min)
        this_scale = xp.where(clamped, sum_xl / sum_l2, this_scale)
        current = error(this_scale, this_min, lf)
        better = (det > 0) & (current < best)
        levels = xp.where(better, lf, levels)
        best = xp.where(better, current, best)
        scale = xp.where(better, this_scale, scale)
        low = xp.where(better, this_min, low)
    levels = xp.astype(levels, np.int32)
    return xp.where(flat, F32(0), scale), xp.where(flat, -flat_min, -low), xp.where(flat, 0, levels)


def make_qp_quants(x, nmax, weights):
    """``make_qp_quants(n, nmax, x, L, quant_weights)``: (scale, L as the uint8 values C leaves)."""
    xp = namespace(x)
    largest = xp.zeros(x.shape[1:], F32, x)
    for value in x:
        largest = xp.where(largest > value, largest, value)  # MAX(max, x[i])
    zero = largest < GROUP_MAX_EPS
    wx = weights * x

    def mse(scale, q):
        diff = x - scale * as_f32(q)
        return seqsum(weights * diff, diff)

    iscale = xp.div(F32(nmax), largest)
    best = mse(xp.div(F32(1), iscale), to_uint8(nearest_int(iscale * x)))
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_step = xp.div(F32(0.1) * F32(step) + F32(nmax), largest)
        current = mse(xp.div(F32(1), iscale_step), xp.cap(nearest_int(iscale_step * x), nmax))
        better = current < best
        best = xp.where(better, current, best)
        iscale = xp.where(better, iscale_step, iscale)
    q = xp.cap(nearest_int(iscale * x), nmax)
    levels = to_uint8(q)
    lf = as_f32(q)
    sumlx, suml2 = seqsum(wx, lf), seqsum(weights * lf, lf)
    for _ in range(5):
        changed = xp.zeros(x.shape[1:], bool, x)
        for i in range(x.shape[0]):
            li = as_f32(levels[i])
            slx = sumlx - wx[i] * li
            sl2 = suml2 - (weights[i] * li) * li
            new_l = xp.cap(nearest_int((x[i] * sl2) / slx), nmax)
            new_f = as_f32(new_l)
            slx_new = slx + wx[i] * new_f
            sl2_new = sl2 + (weights[i] * new_f) * new_f
            accept = (slx > 0) & (sl2 > 0) & (new_l != levels[i])
            accept &= (slx_new * slx_new) * suml2 > (sumlx * sumlx) * sl2_new
            levels[i] = xp.where(accept, to_uint8(new_l), levels[i])
            sumlx = xp.where(accept, slx_new, sumlx)
            suml2 = xp.where(accept, sl2_new, suml2)
            changed |= accept
        if not xp.to_bool(changed.any()):
            break
    scale = xp.where(suml2 > 0, sumlx / suml2, F32(0))
    return xp.where(zero, F32(0), scale), xp.where(zero, 0, levels)


_INDEX_TABLES: dict = {}


def _index_tables(table, like):
    """``best_index_int8``'s lookup by floor(x): for each bucket from table[0] - 1 to table[-1] + 1, the lower index
    of its pair and the pair's two values, where ``like`` lives (made once per table and device)."""
    xp = namespace(like)
    key = (bytes(np.asarray(table, dtype=np.int64)), xp is NUMPY or str(like.device))
    if key not in _INDEX_TABLES:
        first, last, *parts = _index_table_values(table)
        _INDEX_TABLES[key] = (first, last, *(xp.table(part, like) for part in parts))
    return _INDEX_TABLES[key]


def _index_table_values(table):
    first, last = int(table[0]), int(table[-1])
    values = np.asarray(table, dtype=F32)
    buckets = np.arange(first - 1, last + 2)
    lower = np.clip(np.searchsorted(np.asarray(table), buckets, side="right"), 1, len(values) - 1) - 1
    return first, last, lower, values[lower], values[lower + 1]


def best_index_int8(table, x):
    """``best_index_int8(n, val, x)`` for a sorted table of integers: (index, table value) of the value nearest
    ``x``, ties, NaN and infinities as C's bisection resolves them. The bisection ends on the pair val[mu - 1] <= x <
    val[mu] (the first or the last pair beyond the table's ends, which the comparison then resolves as C's end tests
    do); with integer values that pair depends on floor(x) only, so it is read from a table by floor(x)."""
    xp = namespace(x)
    first, last, lower, below_of, above_of = _index_tables(table, x)
    bucket = xp.fmax(xp.fmin(x, F32(last + 1)), F32(first - 1))  # fmin first: NaN goes to the top pair
    bucket = xp.astype(xp.floor(bucket), np.int64) - (first - 1)
    below, above = below_of[bucket], above_of[bucket]
    nearer_below = x - below < above - x
    return lower[bucket] + xp.astype(~nearer_below, np.int64), xp.where(nearer_below, below, above)


def to_groups(blocks, size):
    """Blocks (B, block) as groups of ``size`` values, one per column, group j of block b at column ``j * B + b``:
    (size, block / size * B)."""
    count = blocks.shape[0]
    xp = namespace(blocks)
    return xp.contiguous(xp.permute(blocks.reshape(count, -1, size), 2, 1, 0)).reshape(size, -1)


def from_groups(levels, count):
    """The inverse of ``to_groups`` for the levels: (B, block)."""
    size = levels.shape[0]
    xp = namespace(levels)
    return xp.contiguous(xp.permute(levels.reshape(size, -1, count), 2, 1, 0)).reshape(count, -1)


def block_sum_squares(groups, count):
    """``for (l = 0; l < block; ++l) s += x[l] * x[l];`` per block, from groups laid out by ``to_groups``."""
    xp = namespace(groups)
    squares = (groups * groups).reshape(groups.shape[0], -1, count)
    total = xp.zeros(count, F32, groups)
    for j in range(squares.shape[1]):
        for element in squares[:, j]:
            total += element
    return total


def row_mean_squares(rows):
    """``sum_x2 / n_per_row`` per row, the sum in C's order: (n_rows,)."""
    xp = namespace(rows)
    total = xp.zeros(rows.shape[0], F32, rows)
    for column in xp.contiguous(rows.T):
        total += column * column
    return xp.div(total, F32(rows.shape[1]))


def half_bytes(bits):
    """fp16 bit patterns (B,) as the two little-endian bytes C stores: (B, 2)."""
    return namespace(bits).stack([bits & 0xFF, (bits >> 8) & 0xFF], axis=-1)


def pack_2bit(levels):
    """The K types' 2-bit plane: byte ``j / 4 + l`` of each 128 values holds levels ``j + l + 32 k`` at bits 2k."""
    quads = levels.reshape(levels.shape[0], -1, 4, 32)
    return (quads[:, :, 0] | (quads[:, :, 1] << 2) | (quads[:, :, 2] << 4) | (quads[:, :, 3] << 6)).reshape(
        levels.shape[0], -1
    )


def roundf(values):
    """C's ``roundf``: to the nearest integer, halves away from zero (the fraction ``v - trunc(v)`` is exact)."""
    xp = namespace(values)
    whole = xp.trunc(values)
    return whole + xp.where(xp.abs(values - whole) >= F32(0.5), xp.sign(values), F32(0))


def pack_nibbles(levels):
    """The 32-value blocks' 4-bit packing: byte j holds value j (low) and value j + 16 (high), per 32: (B, n / 2)."""
    pairs = levels.reshape(levels.shape[0], -1, 2, 16)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(levels.shape[0], -1)


def fifth_bits(levels):
    """Q5_0 / Q5_1's ``qh``: bit j of a little-endian uint32 is bit 4 of value j: (B, 4) bytes."""
    xp = namespace(levels)
    bits = ((levels >> 4) & 1).reshape(levels.shape[0], 4, 8)
    return xp.sum_last(bits << xp.table(np.arange(8), levels))  # distinct bits: the sum is their OR


def min_max(x):
    """``min = FLT_MAX; max = -FLT_MAX; if (v < min) min = v; if (v > max) max = v;``: (min, max)."""
    xp = namespace(x)
    low = xp.full(x.shape[1:], np.finfo(F32).max, F32, x)
    high = xp.full(x.shape[1:], -np.finfo(F32).max, F32, x)
    for value in x:
        low = xp.where(value < low, value, low)
        high = xp.where(value > high, value, high)
    return low, high


def weighted_by_row(weights, mean_square, x):
    """The legacy types' importance weights: ``qw[j] * sqrtf(sigma2 + x[j] * x[j])`` with sigma2 the row's mean
    square, for groups of one block each (x (32, B), weights (B, 32), mean_square (B,))."""
    xp = namespace(x)
    return xp.contiguous(weights.T) * xp.sqrt(mean_square + x * x)
