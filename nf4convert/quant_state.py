"""The 4-bit quant state: canonical code tables, parsing from a checkpoint, validation.

A quant state is anything with bitsandbytes' ``QuantState`` fields: ``absmax``, ``shape``, ``code``,
``dtype``, ``blocksize``, ``quant_type``, ``offset``, ``state2`` (``absmax``, ``code``, ``blocksize``)
and ``nested``. :class:`QuantState4bit` is this project's own, built from checkpoint tensors without
importing bitsandbytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

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
FP4_CODE = tuple(
    sign * value / 12.0
    for sign in (1.0, -1.0)
    for value in (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0)
)
CODES = {"nf4": NF4_CODE, "fp4": FP4_CODE}

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
OUT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
QUANT_SUFFIXES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
QUANT_STATE_PREFIX = "quant_state.bitsandbytes__"

_code_cache: dict[tuple[str, torch.device], torch.Tensor] = {}


def canonical_code(quant_type: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fp32 [16] table bitsandbytes' CUDA kernels decode ``quant_type`` nibbles with."""
    device = torch.device(device)
    key = (quant_type, device)
    table = _code_cache.get(key)
    if table is None:
        table = torch.tensor(CODES[quant_type], dtype=torch.float32, device=device)
        _code_cache[key] = table
    return table


def matches_canonical(quant_type: str, quant_map: torch.Tensor) -> bool:
    """Whether a stored quant_map is the canonical table, up to the sign of FP4's zero."""
    if quant_map.numel() != 16:
        return False
    stored = quant_map.detach().to("cpu", torch.float32).reshape(16)
    return bool(torch.equal(stored, canonical_code(quant_type)))  # +0.0 == -0.0 here


@dataclass
class NestedState:
    absmax: torch.Tensor  # fp32, one per `blocksize` entries of the outer uint8 absmax
    code: torch.Tensor  # fp32 [256], the dynamic 8-bit map
    blocksize: int
    dtype: torch.dtype = torch.float32


@dataclass
class QuantState4bit:
    """bitsandbytes' QuantState fields, for a weight read from a checkpoint."""

    absmax: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    blocksize: int
    quant_type: str
    code: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    state2: NestedState | None = None
    nested: bool = field(init=False)

    def __post_init__(self):
        self.nested = self.state2 is not None


class QuantStateError(ValueError):
    """A quant state that cannot be what bitsandbytes wrote (names the tensor and the fault)."""


def parse_quant_state_json(raw: bytes | torch.Tensor, *, name: str) -> dict[str, Any]:
    """Decode the packed ``quant_state.bitsandbytes__*`` tensor (UTF-8 JSON bytes) and check it."""
    if isinstance(raw, torch.Tensor):
        raw = raw.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    try:
        meta = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise QuantStateError(f"{name}: quant state is not valid JSON ({error.msg if hasattr(error, 'msg') else error})") from None
    if not isinstance(meta, dict):
        raise QuantStateError(f"{name}: quant state JSON is not an object")
    return check_quant_state_meta(meta, name=name)


def check_quant_state_meta(meta: dict[str, Any], *, name: str) -> dict[str, Any]:
    for key in ("quant_type", "blocksize", "dtype", "shape"):
        if key not in meta:
            raise QuantStateError(f"{name}: quant state has no '{key}'")
    if meta["quant_type"] not in CODES:
        raise QuantStateError(f"{name}: quant_type {meta['quant_type']!r} is not nf4 or fp4")
    if meta["blocksize"] not in BLOCKSIZES:
        raise QuantStateError(f"{name}: blocksize {meta['blocksize']!r} is not one of {BLOCKSIZES}")
    if meta["dtype"] not in OUT_DTYPES:
        raise QuantStateError(f"{name}: dtype {meta['dtype']!r} is not float16, bfloat16 or float32")
    shape = meta["shape"]
    if not isinstance(shape, list) or not shape or not all(isinstance(d, int) and d > 0 for d in shape):
        raise QuantStateError(f"{name}: shape {shape!r} is not a list of positive integers")
    if "nested_blocksize" in meta or "nested_offset" in meta:
        blocksize2 = meta.get("nested_blocksize")
        if not isinstance(blocksize2, int) or blocksize2 <= 0 or blocksize2 & (blocksize2 - 1):
            raise QuantStateError(f"{name}: nested_blocksize {blocksize2!r} is not a power of two")
        if not isinstance(meta.get("nested_offset"), (int, float)):
            raise QuantStateError(f"{name}: quant state has no numeric 'nested_offset'")
    return meta


def build_quant_state(
    meta: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    *,
    name: str,
    device: torch.device | str = "cpu",
) -> QuantState4bit:
    """A :class:`QuantState4bit` from parsed JSON and the tensors keyed by suffix (``absmax``, ...)."""
    nested = "nested_blocksize" in meta
    needed = ("absmax", "nested_absmax", "nested_quant_map") if nested else ("absmax",)
    for suffix in needed:
        if suffix not in tensors:
            raise QuantStateError(f"{name}: quant state is missing '{name}.{suffix}'")
    state2 = offset = None
    if nested:
        state2 = NestedState(
            absmax=tensors["nested_absmax"].to(device, torch.float32),
            code=tensors["nested_quant_map"].to(device, torch.float32),
            blocksize=int(meta["nested_blocksize"]),
        )
        offset = torch.tensor(float(meta["nested_offset"]), dtype=torch.float32, device=device)
    return QuantState4bit(
        absmax=tensors["absmax"].to(device),
        shape=torch.Size(meta["shape"]),
        dtype=OUT_DTYPES[meta["dtype"]],
        blocksize=int(meta["blocksize"]),
        quant_type=meta["quant_type"],
        code=tensors["quant_map"].to(device) if "quant_map" in tensors else None,
        offset=offset,
        state2=state2,
    )


def check_sizes(packed_bytes: int, quant_state: Any, *, name: str = "weight") -> None:
    """Raise ValueError unless the packed size and the absmax sizes fit ``quant_state.shape``."""
    n_elements = math.prod(quant_state.shape)
    if packed_bytes != (n_elements + 1) // 2:
        raise ValueError(
            f"{name}: {packed_bytes} packed bytes do not hold shape {tuple(quant_state.shape)} "
            f"({(n_elements + 1) // 2} bytes expected)"
        )
    n_blocks = -(-n_elements // quant_state.blocksize)
    if quant_state.absmax.numel() != n_blocks:
        raise ValueError(
            f"{name}: absmax has {quant_state.absmax.numel()} entries, {n_blocks} expected "
            f"for {n_elements} elements in blocks of {quant_state.blocksize}"
        )
    if quant_state.nested:
        state2 = quant_state.state2
        if quant_state.absmax.dtype != torch.uint8:
            raise ValueError(f"{name}: nested absmax must be uint8, not {quant_state.absmax.dtype}")
        n_nested = -(-n_blocks // state2.blocksize)
        if state2.absmax.numel() != n_nested:
            raise ValueError(
                f"{name}: nested_absmax has {state2.absmax.numel()} entries, {n_nested} expected"
            )
        if state2.code.numel() != 256:
            raise ValueError(f"{name}: nested_quant_map has {state2.code.numel()} entries, 256 expected")
    elif not quant_state.absmax.is_floating_point():
        raise ValueError(f"{name}: absmax must be floating point without a nested state, not {quant_state.absmax.dtype}")
