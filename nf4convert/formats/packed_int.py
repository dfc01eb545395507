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
    """The first ``count`` ``bits``-bit codes (0 .. 2**bits - 1, int64) of the bit stream that ``words`` (a signed
    integer tensor read as unsigned words) packs along ``dim``; the other dimensions as they are.

    The caller has checked that ``words`` holds at least ``count`` codes along ``dim``.
    """
    import torch

    width = words.element_size() * 8
    mask = (1 << bits) - 1
    moved = words.movedim(dim, -1).to(torch.int64) & ((1 << width) - 1)
    position = torch.arange(count, dtype=torch.int64, device=words.device) * bits
    word, shift = position // width, position % width
    window = moved[..., word]
    if width % bits:  # codes straddle words: take the spilling bits of the next word (masked, so no overflow)
        following = (word + 1).clamp(max=moved.shape[-1] - 1)
        window = window | ((moved[..., following] & mask) << width)
    return ((window >> shift) & mask).movedim(-1, dim)


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
