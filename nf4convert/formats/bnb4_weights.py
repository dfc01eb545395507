"""The 4-bit weights of a checkpoint: which tensors are a weight and its quant state, found from the headers and
checked (the tiny JSON and table tensors read), and a weight's quant state loaded for its dequantization.

A 4-bit weight ``W`` in a checkpoint is ``W`` (the packed bytes) plus ``W.absmax``, ``W.quant_map`` and, with
double quantization, ``W.nested_absmax`` and ``W.nested_quant_map``, and ``W.quant_state.bitsandbytes__{nf4,fp4}``.
What a quant state is, and its checks, are ``bnb4.py``'s. The format registers here (``Bnb4bit``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar

from ..dtypes import BY_NAME, DTYPES, OUTPUT_DTYPES, to_float32
from ..errors import CheckpointError
from ..safetensors_io.read import TensorInfo, TensorReader
from .base import register
from .bnb import Bitsandbytes
from .bnb4 import CODES, NestedState, QuantState4bit, layout_problem, matches_canonical, not_flat, parse_meta

PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")  # suffixes of a weight's quant-state tensors
STATE_KEY = re.compile(r"^(?P<weight>.+)\.quant_state\.bitsandbytes__(?P<quant_type>[^.]*)$")
MAX_STATE_BYTES = 1 << 16  # bitsandbytes writes ~200 bytes; anything far larger is not a quant state
# The tensors whose bytes the plan reads (_check, quant states): all small (a headers-only copy holds just these).
PLAN_READS = re.compile(r"\.(?:" + "|".join(PARTS[1:]) + r"|quant_state\.bitsandbytes__[^.]*)$")  # all parts but absmax


_PART_KEY = re.compile(r"^(?P<weight>.+)\.(?:" + "|".join(PARTS) + r"|quant_state\.bitsandbytes__[^.]*)$")


@register
class Bnb4bit(Bitsandbytes):
    """bitsandbytes 4-bit (NF4/FP4) checkpoints."""

    name: ClassVar[str] = "bnb-4bit"
    title: ClassVar[str] = "bitsandbytes 4-bit"
    name_suffix: ClassVar[str] = r"(?:bnb-)?(?:4bit|nf4|fp4)"
    plan_reads: ClassVar[re.Pattern] = PLAN_READS
    marks: ClassVar[str] = "a 4-bit quant state"
    card_tags: ClassVar[frozenset[str]] = Bitsandbytes.card_tags | {
        *("bnb-4bit", "bnb-nf4", "nf4", "fp4"),
        *("4-bit", "4bit", "int4"),
    }
    only, other = "load_in_4bit", "load_in_8bit"

    @classmethod
    def is_quantization_key(cls, tensor_name: str) -> bool:
        return bool(STATE_KEY.match(tensor_name)) or tensor_name.endswith(tuple("." + part for part in PARTS))

    @classmethod
    def exactness(cls, dtype_flag: str, several: bool) -> str:
        return (
            f"Every weight dequantized{' from 4-bit' if several else ''} is bit for bit what bitsandbytes' "
            "`dequantize_4bit` computes from the quantized checkpoint with its CUDA kernels: the weights "
            "its 4-bit layers dequantize to, in a format that loads without bitsandbytes."
        )


@dataclass(frozen=True, eq=False)
class Weight4bit:
    """A 4-bit weight in a checkpoint: its packed tensor, its quant-state tensors (wherever they sit) and JSON."""

    name: str
    packed: TensorInfo
    parts: dict  # suffix ("absmax", ..., "quant_state") -> TensorInfo
    meta: dict

    @property
    def shape(self) -> tuple:
        return tuple(self.meta["shape"])

    @property
    def nested(self) -> bool:
        return "nested_blocksize" in self.meta

    @property
    def quant_type(self) -> str:
        return self.meta["quant_type"]

    @property
    def sources(self) -> tuple:
        return (self.packed, *self.parts.values())


def find_weights(tensors: dict[str, TensorInfo], reader: TensorReader) -> list[Weight4bit]:
    """Every 4-bit weight of a checkpoint, checked; CheckpointError (naming file and tensor) for anything wrong.

    A tensor named like a quant-state part whose weight has no quant state is an error, never a plain
    tensor: copying it through would write packed bytes as a "dense" weight.
    """
    weights = []
    for key, info in tensors.items():
        match = STATE_KEY.match(key)
        if match is None:
            continue
        name, quant_type = match["weight"], match["quant_type"]
        where = f"{info.path}: {name}"
        if quant_type not in CODES:
            raise CheckpointError(f"{where}: unknown quant state '{key}' (only nf4 and fp4 are 4-bit)")
        if name not in tensors:
            raise CheckpointError(f"{info.path}: quant state '{key}' has no packed weight '{name}' in any shard")
        if info.dtype != "U8" or len(info.shape) != 1 or info.nbytes > MAX_STATE_BYTES:
            raise CheckpointError(
                f"{where}: quant state '{key}' is not a 1-D U8 tensor of at most {MAX_STATE_BYTES} JSON bytes"
            )
        meta = parse_meta(reader.array(info).tobytes(), where=where)
        if meta["quant_type"] != quant_type:
            raise CheckpointError(f"{where}: quant state key says {quant_type}, its JSON says {meta['quant_type']}")
        parts = {suffix: tensors[f"{name}.{suffix}"] for suffix in PARTS if f"{name}.{suffix}" in tensors}
        parts["quant_state"] = info
        weight = Weight4bit(name, tensors[name], parts, meta)
        _check(weight, reader)
        weights.append(weight)
    consumed = {source.name for weight in weights for source in weight.sources}
    for key, info in tensors.items():
        match = _PART_KEY.match(key)
        if match and key not in consumed:
            raise CheckpointError(
                f"{info.path}: '{key}' is part of the 4-bit quant state of '{match['weight']}', "
                f"which has no '{match['weight']}.quant_state.bitsandbytes__nf4/fp4' tensor"
            )
    return weights


def unclaimed_packed(tensors: dict[str, TensorInfo], weights: list[Weight4bit], quantization: dict | None) -> None:
    """CheckpointError for a tensor that looks like a packed 4-bit weight but has no quant state at all (every part
    lost, or never saved): ``X.weight`` of shape [n, 1] in the 4-bit storage dtype (``bnb_4bit_quant_storage``,
    uint8 by default), in a checkpoint that is 4-bit (its quantization_config says so, or other weights are).
    Copied through, its packed bytes would be written as a dense weight. (No dense layer of a model stores its
    weight [n, 1] in the storage dtype.)"""
    quantization = quantization or {}
    if not weights and not quantization.get("load_in_4bit"):
        return
    storage = BY_NAME.get(str(quantization.get("bnb_4bit_quant_storage") or "uint8").removeprefix("torch."))
    packed_codes = {"U8", storage.code if storage is not None else "U8"} | {weight.packed.dtype for weight in weights}
    claimed = {weight.name for weight in weights}
    for name, info in tensors.items():
        if (
            name.endswith(".weight")
            and name not in claimed
            and info.dtype in packed_codes
            and len(info.shape) == 2
            and info.shape[1] == 1
        ):
            raise CheckpointError(
                f"{info.path}: '{name}' looks like a packed 4-bit weight ({info.dtype} {list(info.shape)}) "
                f"but has no quant state ('{name}.quant_state.bitsandbytes__nf4' or __fp4, absmax, "
                "quant_map): not in the checkpoint"
            )


def _check(weight: Weight4bit, reader: TensorReader) -> None:
    where = f"{weight.packed.path}: {weight.name}"
    needed = PARTS if weight.nested else PARTS[:2]
    for suffix in needed:
        if suffix not in weight.parts:
            raise CheckpointError(f"{where}: quant state is missing '{weight.name}.{suffix}'")
    if not weight.nested and "nested_absmax" in weight.parts:
        raise CheckpointError(f"{where}: has nested_absmax but its quant state JSON has no nested_blocksize")
    for suffix in needed:
        if problem := not_flat(f"'{weight.name}.{suffix}'", weight.parts[suffix].shape):
            raise CheckpointError(f"{where}: {problem}")
    absmax = weight.parts["absmax"]
    nested = weight.parts.get("nested_absmax") if weight.nested else None
    problem = layout_problem(
        packed_bytes=weight.packed.nbytes,
        shape=weight.shape,
        blocksize=weight.meta["blocksize"],
        absmax_count=math.prod(absmax.shape),
        absmax_float=DTYPES[absmax.dtype].cast,
        absmax_u8=absmax.dtype == "U8",
        nested_blocksize=weight.meta.get("nested_blocksize"),
        nested_count=nested and math.prod(nested.shape),
        nested_float=nested is not None and DTYPES[nested.dtype].cast,
        code2_count=math.prod(weight.parts["nested_quant_map"].shape) if weight.nested else 256,
    )
    if problem:
        raise CheckpointError(f"{where}: {problem}")
    for suffix in ("quant_map", "nested_quant_map")[: 1 + weight.nested]:
        if not DTYPES[weight.parts[suffix].dtype].cast:
            raise CheckpointError(f"{where}: {suffix} is {weight.parts[suffix].dtype}, not floating point")
    quant_map = weight.parts["quant_map"]
    if math.prod(quant_map.shape) != 16 or not matches_canonical(weight.quant_type, _floats(reader, quant_map)):
        raise CheckpointError(f"{where}: quant_map is not bitsandbytes' {weight.quant_type} table")
    if weight.nested:  # small (one float per nested block, 256 codes), so read here as 8-bit scales are
        for suffix in ("nested_absmax", "nested_quant_map"):
            _check_finite(where, suffix, _floats(reader, weight.parts[suffix]), signed=suffix == "nested_quant_map")


def _floats(reader: TensorReader, info: TensorInfo):
    """A float tensor's values as a flat fp32 numpy array (F64 rounded)."""
    return to_float32(reader.array(info), info.dtype)


def _check_finite(where: str, suffix: str, values, signed: bool = False) -> None:
    """Refuse a quant-state table (fp32 numpy values) with a NaN or infinite value (or a negative one, where it holds
    absmaxes)."""
    import numpy as np

    if not bool(np.isfinite(values).all()) or (not signed and bool((values < 0).any())):
        raise CheckpointError(
            f"{where}: {suffix} holds a negative, NaN or infinite value; bitsandbytes writes "
            "finite block absmaxes (every weight of such a block would come out NaN or inf)"
        )


def load_state(weight: Weight4bit, reader: TensorReader, *, dtype: str | None = None) -> QuantState4bit:
    """The weight's quant state as read from the checkpoint, in numpy (no torch): absmax flat (uint8 codes when
    nested, else fp32), the nested absmax and code fp32, offset a float, dtype the output's safetensors name
    (``dtype``, or the one the quant state names)."""
    meta = weight.meta
    state2 = offset = None
    if weight.nested:
        state2 = NestedState(
            absmax=_floats(reader, weight.parts["nested_absmax"]),
            code=_floats(reader, weight.parts["nested_quant_map"]),
            blocksize=int(meta["nested_blocksize"]),
        )
        offset = float(meta["nested_offset"])
        absmax = reader.array(weight.parts["absmax"])
    else:  # a flat absmax (one float per block, 1/8 of the packed bytes): checked here, where it is read anyway
        absmax = _floats(reader, weight.parts["absmax"])
        _check_finite(f"{weight.packed.path}: {weight.name}", "absmax", absmax)
    return QuantState4bit(
        absmax=absmax,
        shape=tuple(meta["shape"]),
        dtype=dtype or OUTPUT_DTYPES[meta["dtype"]].code,
        blocksize=int(meta["blocksize"]),
        quant_type=meta["quant_type"],
        offset=offset,
        state2=state2,
    )
