"""Integer codes packed into words, as GPTQ, AWQ and compressed-tensors store them: the one unpacking rule they share,
and the small shape and config checks their format modules make alike.

Every one of these layouts is a little-endian bit stream: code ``i`` of a run along one dimension occupies bits
``[i * bits, (i + 1) * bits)`` of the run's words laid end to end, word ``k`` holding stream bits
``[k * width, (k + 1) * width)``. With 2, 4 or 8 bits a code never leaves its word (GPTQ's and AWQ's shift tables,
compressed-tensors' byte split); with 3 bits every third code straddles two words (GPTQ's "10-1-10-1-10" words,
compressed-tensors' dense packing). AWQ's GEMM layout permutes the codes inside each word afterwards (``formats/awq``).

Unpacking here is exact on every device: the words are widened to int64 and masked to their unsigned value, and
each code is one shift and mask of a 64-bit window of at most two words (the second masked to the bits that spill,
so no shift overflows); int64 shifts, ands, ors and gathers are the same integer operations on a CPU and a GPU.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

from ..errors import CheckpointError
from ..safetensors_io.read import TensorInfo

if TYPE_CHECKING:
    import torch

    from ..safetensors_io.read import TensorReader

# The packed words these formats write: safetensors' name -> bits per word.
WORD_BITS = {"I8": 8, "I16": 16, "I32": 32}
SCALE_DTYPES = ("F16", "BF16")


def unpack(words: torch.Tensor, bits: int, count: int, dim: int = -1) -> torch.Tensor:
    """The first ``count`` ``bits``-bit codes (0 .. 2**bits - 1) of the bit stream that ``words`` (a signed integer
    tensor read as unsigned words) packs along ``dim``, the other dimensions as they are: uint8 for 1, 2, 4 and 8 bits
    (codes inside bytes), int64 otherwise.

    The caller has checked that ``words`` holds at least ``count`` codes along ``dim``.
    """
    import torch

    moved = words.movedim(dim, -1)
    if 8 % bits == 0 and sys.byteorder == "little":
        # The stream's bytes are the words' bytes in memory order (little-endian words): each byte split in halves,
        # low half first, until the halves are codes. Whole-tensor integer operations, the same on a CPU and a GPU.
        codes = moved.contiguous().view(torch.uint8)
        for half in (4, 2, 1)[: {8: 0, 4: 1, 2: 2, 1: 3}[bits]]:
            pairs = codes.to(torch.int16)
            pairs.bitwise_or_(pairs << (8 - half)).bitwise_and_(((1 << half) - 1) * 0x0101)
            codes = pairs.view(torch.uint8)
        return codes[..., :count].movedim(-1, dim)
    width = words.element_size() * 8
    mask = (1 << bits) - 1
    moved = moved.to(torch.int64) & ((1 << width) - 1)
    position = torch.arange(count, dtype=torch.int64, device=words.device) * bits
    word, shift = position // width, position % width
    window = moved[..., word]
    if width % bits:  # codes straddle words: take the spilling bits of the next word (masked, so no overflow)
        following = (word + 1).clamp(max=moved.shape[-1] - 1)
        window = window | ((moved[..., following] & mask) << width)
    return ((window >> shift) & mask).movedim(-1, dim)


def scaled(codes, zeros, scales, *, group_size=None, index=None, order=None, out_dtype=None, out=None):
    """``scales[r, g] * (codes[r, c] - zeros[r, g])`` for every row ``r`` and column ``c`` of ``codes`` [rows, in] (any
    integer dtype), ``g`` the column's group; ``zeros`` [rows, groups] (any integer dtype) or None (symmetric),
    ``scales`` [rows, groups] of a float dtype. Returns the [rows, in] result in ``out_dtype`` (the scales' by default),
    contiguous, or writes it into ``out``. The column's group is

    - ``c // group_size`` (the last group may be partial): computed group by group on broadcast views of the zeros and
      scales, in place in the result, no per-column copies;
    - ``index[c]``, any group index: each column's zero and scale gathered (full-size operands, slower);
    - with ``order`` (the columns' permutation that puts them in groups of ``group_size`` in order: desc_act's), the
      first way on the columns so ordered, then put back in place (data movement only).

    Exact as every reference: codes and zeros are integers of at most 8 bits, exact in fp16, bf16 and fp32, and so is
    their difference (at most 255 in magnitude: no rounding in the float subtraction); the one multiply rounds once in
    the scales' dtype (fp16 and bf16 products are exact in fp32, where torch computes them on a CPU and a GPU, then
    rounded to nearest even); then the cast."""
    import torch

    rows, columns = codes.shape
    dtype = scales.dtype
    target = out if out is not None else torch.empty(rows, columns, dtype=out_dtype or dtype, device=codes.device)
    if index is not None:
        return _gathered(codes, zeros, scales, index.to(torch.int64), target)
    if order is not None:
        order = order.to(torch.int64)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(columns, device=order.device)
        in_order = scaled(_columns(codes, order), zeros, scales, group_size=group_size, out_dtype=target.dtype)
        return _columns(in_order, inverse, target)
    dense = target if target.dtype == dtype else torch.empty(rows, columns, dtype=dtype, device=codes.device)
    zeros = None if zeros is None else zeros.to(dtype)  # exact: integers of at most 8 bits (9 with a sign)
    whole = columns // group_size
    for first, groups, size in ((0, whole, group_size), (whole * group_size, 1, columns - whole * group_size)):
        if not groups or not size:
            continue
        part = codes[:, first : first + groups * size].reshape(rows, groups, size)
        result = dense[:, first : first + groups * size].view(rows, groups, size)
        group = slice(first // group_size, first // group_size + groups)
        if zeros is None:
            result.copy_(part)
        else:
            torch.sub(part, zeros[:, group, None], out=result)
        result.mul_(scales[:, group, None])
    if dense is not target:
        target.copy_(dense)
    return target


def _gathered(codes, zeros, scales, index, target):
    """``scaled`` for any group index: each column's zero and scale gathered (slower: full-size operands)."""
    import torch

    dense = torch.empty(codes.shape, dtype=scales.dtype, device=codes.device)
    dense.copy_(codes)
    if zeros is not None:
        dense.sub_(_columns(zeros.to(scales.dtype), index))
    dense.mul_(_columns(scales, index))
    target.copy_(dense)
    return target


def _columns(source, index, out=None):
    """``source[:, index]`` (into ``out``): numpy's take on a CPU, many times faster there than torch's column
    gather; torch's on a GPU. Data movement only."""
    import torch

    if source.device.type != "cpu":
        taken = source.index_select(1, index)
        return taken if out is None else out.copy_(taken)
    import numpy as np

    out = torch.empty(source.shape[0], index.shape[0], dtype=source.dtype) if out is None else out
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[source.element_size()]
    source = source.contiguous().view(integer).numpy()
    np.take(source, index.numpy(), axis=1, out=out.view(integer).numpy(), mode="wrap")  # valid: no checks
    return out


def packed_length(count: int, bits: int, width: int) -> int:
    """How many ``width``-bit words hold ``count`` ``bits``-bit codes packed densely."""
    return math.ceil(count * bits / width)


def where(info: TensorInfo) -> str:
    """How a message names a tensor: its file and name."""
    return f"{info.path}: tensor '{info.name}'"


def check_shape(info: TensorInfo, expected: tuple, what: str) -> None:
    """CheckpointError unless ``info`` has shape ``expected``; ``what`` says why that shape."""
    if tuple(info.shape) != tuple(expected):
        raise CheckpointError(f"{where(info)} has shape {list(info.shape)}, {what}: {list(expected)} expected")


def check_dtype(info: TensorInfo, allowed: tuple[str, ...], what: str) -> None:
    """CheckpointError unless ``info``'s dtype is one of ``allowed``; ``what`` names the tensor's role."""
    if info.dtype not in allowed:
        raise CheckpointError(f"{where(info)} ({what}) is {info.dtype}, {' or '.join(allowed)} expected")


def check_matrix(info: TensorInfo, what: str) -> None:
    """CheckpointError unless ``info`` is two-dimensional."""
    if len(info.shape) != 2:
        raise CheckpointError(f"{where(info)} ({what}) has shape {list(info.shape)}, a matrix expected")


CONFIG = "config.json"


def config_int(quantization: dict, key: str, allowed, default=None) -> int:
    """An integer setting of a quantization_config (``default`` where absent), one of ``allowed`` (a container or a
    predicate); CheckpointError naming the setting otherwise. Booleans are not integers here."""
    value = quantization.get(key, default)
    ok = type(value) is int and (allowed(value) if callable(allowed) else value in allowed)  # noqa: E721
    if not ok:
        raise CheckpointError(f"{CONFIG}: quantization_config {key}={value!r} is not one this format reads")
    return value


# The exponent bits of each float scale dtype: all set is an infinity or a NaN.
_EXPONENTS = {"F16": (2, 0x7C00), "BF16": (2, 0x7F80), "F32": (4, 0x7F800000)}


def check_finite_scales(reader: TensorReader, info: TensorInfo, what: str, columns: int | None = None) -> None:
    """CheckpointError if a scale tensor (F16, BF16 or F32, checked already) holds a NaN or an infinity (in its first
    ``columns`` columns where the rest is padding): every weight it scales would come out NaN or inf, with NaN bits
    that differ by device. Writers store finite scales; a scale is one value per group, cheap to read."""
    import numpy as np

    width, mask = _EXPONENTS[info.dtype]
    words = reader.array(info).view(np.uint16 if width == 2 else np.uint32).reshape(info.shape)
    if columns is not None:
        words = words[:, :columns]
    bad = np.argwhere((words & mask) == mask)
    if len(bad):
        at = ", ".join(map(str, bad[0].tolist()))
        raise CheckpointError(
            f"{where(info)} ({what}) holds a NaN or infinite scale (at [{at}], {len(bad)} in all); every weight it "
            "scales would be NaN or inf"
        )


def rows_per_piece(piece_bytes: int, row_bytes: int, align: int) -> int:
    """Output rows in a piece of at most ``piece_bytes`` (at least ``align``), a multiple of ``align`` so that every
    piece but the last starts and ends on whole packed words."""
    return max(align, piece_bytes // max(row_bytes, 1) // align * align)


def host_array(reader: TensorReader, info: TensorInfo):
    """A tensor's bits as a numpy array of its shape (bf16 as uint16): what a host computation is handed (it pickles
    as it is, to the CPU route's worker processes; ``as_torch`` gives the tensor back)."""
    from ..dtypes import DTYPES

    return reader.array(info).view(DTYPES[info.dtype].numpy).reshape(info.shape)


def as_torch(array, code: str):
    """The torch tensor of safetensors dtype ``code`` on ``array``'s bits (no copy)."""
    import torch

    from ..dtypes import DTYPES

    return torch.from_numpy(array).view(DTYPES[code].torch)
