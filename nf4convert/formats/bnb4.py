"""bitsandbytes 4-bit (NF4/FP4) weights: the one owner of the quant state.

A 4-bit weight ``W`` in a checkpoint is ``W`` (the packed bytes, two nibbles each, high nibble first)
plus its quant state: ``W.absmax``, ``W.quant_map`` and, with double quantization, ``W.nested_absmax`` and
``W.nested_quant_map``, and ``W.quant_state.bitsandbytes__{nf4,fp4}``, a UTF-8 JSON tensor with
``quant_type``, ``blocksize``, ``dtype``, ``shape`` and, when nested, ``nested_blocksize`` and
``nested_offset``. This module parses and checks all of that (from headers and the tiny JSON/table
tensors), builds the in-memory :class:`QuantState4bit`, and cuts a weight into chunks of whole
(nested) blocks for streaming. The arithmetic is in ``nf4convert.kernels``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from ..dtypes import DTYPES, OUTPUT_DTYPES
from ..errors import ArgumentError, CheckpointError
from ..strict_json import shown, strict_json

if TYPE_CHECKING:
    import torch


# bitsandbytes' CUDA kernels decode the nibble with constants of their own and ignore the stored
# quant_map, so these tables, not the checkpoint's, are the truth. FP4 nibble 8 is -0.0 there
# (sign * 0.0f), although get_4bit_type stores +0.0 (the Python literal -0 is the integer 0).
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
FP4_CODE = tuple(sign * value / 12.0 for sign in (1.0, -1.0) for value in (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0))
CODES = {"nf4": NF4_CODE, "fp4": FP4_CODE}
QUANT_TYPES = tuple(CODES)  # for membership tests that must not raise on an unhashable value

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
META_KEYS = ("quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset")
NESTED_KEYS = ("nested_blocksize", "nested_dtype", "nested_offset")

_code_cache: dict = {}


def canonical_code(quant_type: str, device="cpu") -> torch.Tensor:
    """The fp32 [16] table bitsandbytes' CUDA kernels decode ``quant_type`` nibbles with."""
    import torch

    device = torch.device(device)
    table = _code_cache.get((quant_type, device))
    if table is None:
        table = _code_cache[(quant_type, device)] = torch.tensor(CODES[quant_type], dtype=torch.float32, device=device)
    return table


def matches_canonical(quant_type: str, quant_map) -> bool:
    """Whether a stored quant_map (fp32 numpy values) is the canonical table, up to the sign of FP4's zero."""
    import numpy as np

    return quant_map.size == 16 and bool(np.array_equal(quant_map, np.float32(CODES[quant_type])))  # +0.0 == -0.0 here


@dataclass
class NestedState:
    absmax: torch.Tensor  # fp32, one per ``blocksize`` entries of the outer uint8 absmax
    code: torch.Tensor  # fp32 [256], the dynamic 8-bit map
    blocksize: int
    dtype: Any = None  # bitsandbytes' field; the nested absmax is fp32


@dataclass
class QuantState4bit:
    """bitsandbytes' QuantState fields, for a weight read from a checkpoint (no bitsandbytes import): torch tensors
    for the kernels' API, numpy arrays as read (load_state, the CPU route)."""

    absmax: torch.Tensor
    shape: Any  # torch.Size (a tuple in a state read by load_state)
    dtype: Any  # torch.dtype of the output (its safetensors name, e.g. "BF16", in a state read by load_state)
    blocksize: int
    quant_type: str
    offset: torch.Tensor | None = None
    state2: NestedState | None = None
    nested: bool = field(init=False)

    def __post_init__(self):
        self.nested = self.state2 is not None


def layout_problem(
    *,
    packed_bytes: int,
    shape,
    blocksize: int,
    absmax_count: int,
    absmax_float: bool,
    absmax_u8: bool,
    nested_blocksize: int | None,
    nested_count: int = 0,
    nested_float: bool = True,
    code2_count: int = 256,
) -> str | None:
    """What is wrong with a 4-bit weight's sizes (None when they fit): the one rule for checkpoints and the API."""
    n_elements = math.prod(shape)
    if packed_bytes != (n_elements + 1) // 2:
        return f"{packed_bytes} packed bytes do not hold shape {list(shape)} ({(n_elements + 1) // 2} bytes expected)"
    n_blocks = -(-n_elements // blocksize)
    if absmax_count != n_blocks:
        return (
            f"absmax has {absmax_count} entries, {n_blocks} expected for {n_elements} elements in blocks of {blocksize}"
        )
    if nested_blocksize is None:
        return None if absmax_float else "absmax must be floating point without a nested state"
    if not absmax_u8:
        return "nested absmax must be uint8"
    n_nested = -(-n_blocks // nested_blocksize)
    if not nested_float:
        return "nested_absmax must be floating point (bitsandbytes writes it as F32)"
    if nested_count != n_nested:
        return f"nested_absmax has {nested_count} entries, {n_nested} floats expected"
    if code2_count != 256:
        return f"nested_quant_map has {code2_count} entries, 256 expected"
    return None


def not_flat(name: str, shape) -> str | None:
    """bitsandbytes keeps (and saves) each part of a quant state 1-D; its dequantization, verify's reference, takes
    no other shape. One rule for states read from files (_check) and given to the API (check_state)."""
    return (
        None
        if len(shape) == 1
        else f"{name} has shape {list(shape)}; bitsandbytes keeps the parts of a quant state 1-D"
    )


def check_state(packed_bytes: int, quant_state: Any) -> None:
    """Raise ArgumentError unless a quant state (bitsandbytes' or ours) is one we dequantize for ``packed_bytes``.

    Every field the kernels read is checked here, so that no bad state reaches them as an AttributeError or a
    TypeError. Only Python values and tensor metadata are read, never a tensor's data: under torch.compile these
    checks run while Dynamo traces (reading data would break the graph), and each check Dynamo cannot fold into a
    guard it already has costs a guard per layer on every compiled forward, so types are tested only where a value of
    another type would pass (``64.0 in BLOCKSIZES``), and a missing field is an AttributeError caught, not ``hasattr``.
    """
    import torch

    if isinstance(
        quant_state, dict
    ):  # as_dict()'s form; Dynamo fails on a missing key's AttributeError of an empty one
        raise ArgumentError(
            "quant_state must be a bitsandbytes QuantState or nf4convert.QuantState4bit, not dict "
            "(bitsandbytes' QuantState.from_dict makes one)"
        )
    try:
        quant_type, dtype, blocksize = quant_state.quant_type, quant_state.dtype, quant_state.blocksize
        shape, absmax, nested = quant_state.shape, quant_state.absmax, quant_state.nested
    except AttributeError:
        raise ArgumentError(
            "quant_state must be a bitsandbytes QuantState or nf4convert.QuantState4bit, "
            f"not {type(quant_state).__name__}"
        ) from None
    if quant_type not in QUANT_TYPES:
        raise ArgumentError(f"quant_state.quant_type must be 'nf4' or 'fp4', not {shown(quant_type)}")
    if dtype not in tuple(output.torch for output in OUTPUT_DTYPES.values()):
        kind = "" if isinstance(dtype, torch.dtype) else f" ({type(dtype).__name__}, not a torch.dtype)"
        raise ArgumentError(
            f"quant_state.dtype must be torch.float16, torch.bfloat16 or torch.float32, not {shown(dtype)}{kind}"
        )
    if not _integer(blocksize) or blocksize not in BLOCKSIZES:
        raise ArgumentError(f"quant_state.blocksize must be one of {BLOCKSIZES}, not {shown(blocksize)}")
    if not isinstance(shape, (tuple, list)) or not all(_integer(size) and size >= 0 for size in shape):
        raise ArgumentError(f"quant_state.shape must be a sequence of non-negative ints, not {shown(shape)}")
    if not isinstance(absmax, torch.Tensor):
        raise ArgumentError(f"quant_state.absmax must be a tensor, not {type(absmax).__name__}")
    if problem := not_flat("quant_state.absmax", absmax.shape):
        raise ArgumentError(problem)
    if nested not in (True, False):
        raise ArgumentError(f"quant_state.nested must be True or False, not {shown(nested)}")
    state2 = _nested(quant_state) if nested else None
    problem = layout_problem(
        packed_bytes=packed_bytes,
        shape=tuple(shape),
        blocksize=blocksize,
        absmax_count=absmax.numel(),
        absmax_float=absmax.is_floating_point(),
        absmax_u8=absmax.dtype == torch.uint8,
        nested_blocksize=state2 and state2.blocksize,
        nested_count=state2 and state2.absmax.numel(),
        code2_count=state2.code.numel() if state2 is not None else 256,
    )
    if problem:
        raise ArgumentError(f"packed: {problem}")


def _nested(quant_state: Any) -> Any:
    """A nested quant state's ``state2``, with its fields and the offset checked: every one the kernels read."""
    import torch

    state2, offset = getattr(quant_state, "state2", None), getattr(quant_state, "offset", None)
    if state2 is None:
        raise ArgumentError("quant_state.state2 is None; a nested quant state needs its state2")
    try:
        nested_absmax, code2, blocksize = state2.absmax, state2.code, state2.blocksize
    except AttributeError:
        raise ArgumentError(
            "quant_state.state2 must be a bitsandbytes QuantState or nf4convert's NestedState, "
            f"not {type(state2).__name__}"
        ) from None
    for name, value in (("absmax", nested_absmax), ("code", code2)):
        if not isinstance(value, torch.Tensor):
            raise ArgumentError(f"quant_state.state2.{name} must be a tensor, not {type(value).__name__}")
        if problem := not_flat(f"quant_state.state2.{name}", value.shape):
            raise ArgumentError(problem)
    if not _integer(blocksize) or blocksize <= 0 or blocksize & (blocksize - 1):
        raise ArgumentError(f"quant_state.state2.blocksize must be a power of two, not {shown(blocksize)}")
    if offset is None:
        raise ArgumentError("quant_state.offset is None; a nested quant state needs its offset")
    if isinstance(offset, torch.Tensor):
        if offset.numel() != 1:
            raise ArgumentError(f"quant_state.offset must be one number, not a tensor of {offset.numel()} elements")
    elif not (_integer(offset) or isinstance(offset, float)):
        raise ArgumentError(f"quant_state.offset must be a tensor or a number, not {type(offset).__name__}")
    return state2


def parse_meta(raw: bytes, *, where: str) -> dict:
    """The quant state's JSON (``where`` names file and weight in messages), checked; CheckpointError if bad."""
    meta = strict_json(bytes(raw), f"{where}: quant state is not valid JSON")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}: quant state JSON is not an object")
    for key in ("quant_type", "blocksize", "dtype", "shape"):
        if key not in meta:
            raise CheckpointError(f"{where}: quant state has no '{key}'")
    unknown = sorted(set(meta) - set(META_KEYS))
    if unknown:  # bitsandbytes' QuantState.from_dict refuses them too
        raise CheckpointError(f"{where}: quant state has unknown key {shown(unknown[0])}")
    if not isinstance(meta["quant_type"], str) or meta["quant_type"] not in CODES:
        raise CheckpointError(f"{where}: quant_type {shown(meta['quant_type'])} is not nf4 or fp4")
    if not _integer(meta["blocksize"]) or meta["blocksize"] not in BLOCKSIZES:
        raise CheckpointError(f"{where}: blocksize {shown(meta['blocksize'])} is not one of {BLOCKSIZES}")
    if not isinstance(meta["dtype"], str) or meta["dtype"] not in OUTPUT_DTYPES:
        raise CheckpointError(f"{where}: dtype {shown(meta['dtype'])} is not float16, bfloat16 or float32")
    shape = meta["shape"]
    if not isinstance(shape, list) or not shape or not all(_integer(d) and 0 < d < 2**63 for d in shape):
        raise CheckpointError(f"{where}: shape {shown(shape)} is not a list of positive integers")
    if any(key in meta for key in NESTED_KEYS):
        missing = [key for key in ("nested_blocksize", "nested_dtype") if key not in meta]
        if missing:  # a nested state names all three (nested_offset is checked below)
            raise CheckpointError(f"{where}: quant state has nested keys but no '{missing[0]}'")
        blocksize2 = meta.get("nested_blocksize")
        if not _integer(blocksize2) or blocksize2 <= 0 or blocksize2 & (blocksize2 - 1):
            raise CheckpointError(f"{where}: nested_blocksize {shown(blocksize2)} is not a power of two")
        if meta.get("nested_dtype") != "float32":  # what bitsandbytes writes: its nested absmax is fp32
            raise CheckpointError(f"{where}: nested_dtype {shown(meta.get('nested_dtype'))} is not 'float32'")
        offset = meta.get("nested_offset")
        if not (_integer(offset) or isinstance(offset, float)) or not _finite_fp32(offset):
            raise CheckpointError(f"{where}: quant state has no nested_offset that is a finite fp32 number")
    return meta


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_fp32(value) -> bool:
    try:
        return math.isfinite(struct.unpack("<f", struct.pack("<f", value))[0])
    except (OverflowError, struct.error):
        return False


def on_device(state: QuantState4bit, device) -> QuantState4bit:
    """A state from :func:`load_state` as the kernels' torch API takes it: tensors on ``device``, torch dtypes."""
    import torch

    def moved(array, dtype=None):
        return torch.from_numpy(array).to(device, dtype)

    state2 = None
    offset = None if state.offset is None else torch.tensor(state.offset, dtype=torch.float32, device=device)
    if state.nested:
        nested = state.state2
        state2 = NestedState(absmax=moved(nested.absmax), code=moved(nested.code), blocksize=nested.blocksize)
    return QuantState4bit(
        absmax=moved(state.absmax),
        shape=torch.Size(state.shape),
        dtype=DTYPES[state.dtype].torch,
        blocksize=state.blocksize,
        quant_type=state.quant_type,
        offset=offset,
        state2=state2,
    )


def chunks(state: QuantState4bit, chunk_elements: int) -> Iterator[tuple[int, int, QuantState4bit]]:
    """``(first element, element count, quant state of that piece)`` in chunks of whole (nested) blocks, for a state
    in numpy or torch (its arrays sliced, its shape a 1-D one of the same kind).

    Each piece dequantizes on its own: it holds exactly the absmax (and nested absmax)
    entries of its blocks. Its packed bytes are ``[first // 2, first // 2 + (count + 1) // 2)``.
    """

    n = math.prod(state.shape)
    nested_blocksize = state.state2.blocksize if state.nested else 1
    unit = state.blocksize * nested_blocksize
    chunk = max(unit, chunk_elements // unit * unit)
    for first in range(0, n, chunk):
        count = min(chunk, n - first)
        first_block, end_block = first // state.blocksize, -(-(first + count) // state.blocksize)
        state2 = None
        if state.nested:
            nested = state.state2
            state2 = NestedState(
                nested.absmax[first_block // nested_blocksize : -(-end_block // nested_blocksize)],
                nested.code,
                nested_blocksize,
            )
        yield (
            first,
            count,
            QuantState4bit(
                absmax=state.absmax[first_block:end_block],
                shape=type(state.shape)([count]),
                dtype=state.dtype,
                blocksize=state.blocksize,
                quant_type=state.quant_type,
                offset=state.offset,
                state2=state2,
            ),
        )
