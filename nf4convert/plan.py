"""What becomes what: every output tensor's name, dtype, shape, size and shard, from headers alone.

The only tensor data read here are the quant states' tiny JSON and code tables, so a plan for a
70B checkpoint takes a moment, and it knows the exact output size before anything is written.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint import DTYPES, FLOAT_DTYPES, TORCH_TO_SAFETENSORS, OutputTensor, TensorInfo, TensorReader, read_tensors
from .errors import CheckpointError
from .quant_state import CODES, QUANT_STATE_PREFIX, QuantStateError, check_quant_state_meta

QUANT_PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
DTYPE_CHOICES = {"auto": None, "bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
                 "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}  # fmt: skip
# Files a converted checkpoint must not carry over: the old weights, their indexes, caches, VCS data.
SKIPPED_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                 "*.ckpt", "*.h5", "*.msgpack", "*.gguf", ".gitattributes", "*.lock", "*.incomplete")  # fmt: skip
SKIPPED_DIRS = {".cache", ".git", ".huggingface", "__pycache__"}


@dataclass
class QuantGroup:
    """A quantized weight: its packed bytes, its quant-state tensors (wherever they sit) and JSON."""

    name: str
    packed: TensorInfo
    parts: dict[str, TensorInfo]
    meta: dict

    @property
    def shape(self) -> tuple:
        return tuple(self.meta["shape"])

    @property
    def nested(self) -> bool:
        return "nested_blocksize" in self.meta

    @property
    def source_keys(self) -> list[str]:
        return [self.packed.name, *(info.name for info in self.parts.values())]


@dataclass
class PlannedTensor:
    output: OutputTensor
    source: TensorInfo | QuantGroup

    @property
    def quantized(self) -> bool:
        return isinstance(self.source, QuantGroup)


@dataclass
class Shard:
    filename: str
    tensors: list[PlannedTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.output.nbytes for t in self.tensors)


@dataclass
class Plan:
    folder: Path
    dtype: str  # torch dtype name of the output
    shards: list[Shard]
    groups: list[QuantGroup]
    source_tensors: dict[str, TensorInfo]
    other_files: list[Path]
    config: dict | None

    @property
    def tensor_bytes(self) -> int:
        return sum(shard.nbytes for shard in self.shards)

    @property
    def n_tensors(self) -> int:
        return sum(len(shard.tensors) for shard in self.shards)

    @property
    def other_bytes(self) -> int:
        return sum((self.folder / path).stat().st_size for path in self.other_files)


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes -> bytes (decimal units like transformers)."""
    if isinstance(text, int):
        return text
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
    value = text.strip().upper()
    number = value.rstrip("KMGTIB")
    try:
        size = int(float(number) * units[value[len(number):].strip()])
    except (ValueError, KeyError):
        raise ValueError(f"size {text!r} is not like '5GB', '500MB' or a number of bytes") from None
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def _quant_groups(tensors: dict[str, TensorInfo], reader: TensorReader) -> list[QuantGroup]:
    groups = []
    for key, info in tensors.items():
        if QUANT_STATE_PREFIX not in key:
            continue
        name, _, quant_type = key.rpartition("." + QUANT_STATE_PREFIX)
        where = f"{info.path}: {name}"
        if quant_type not in CODES:
            raise CheckpointError(f"{where}: unknown quant state '{key}' (only nf4 and fp4 are 4-bit)")
        if name not in tensors:
            raise CheckpointError(f"{info.path}: quant state '{key}' has no packed weight '{name}' in any shard")
        try:
            meta = json.loads(bytes(reader.read(info).numpy()).decode("utf-8"))
            if not isinstance(meta, dict):
                raise ValueError
        except (UnicodeDecodeError, ValueError):
            raise CheckpointError(f"{where}: quant state is not valid JSON") from None
        try:
            check_quant_state_meta(meta, name=where)
        except QuantStateError as error:
            raise CheckpointError(str(error)) from None
        if meta["quant_type"] != quant_type:
            raise CheckpointError(f"{where}: quant state key says {quant_type}, its JSON says {meta['quant_type']}")
        parts = {suffix: tensors[f"{name}.{suffix}"] for suffix in QUANT_PARTS if f"{name}.{suffix}" in tensors}
        parts["quant_state"] = info
        group = QuantGroup(name, tensors[name], parts, meta)
        _check_group(group, reader)
        groups.append(group)
    return groups


def _check_group(group: QuantGroup, reader: TensorReader) -> None:
    import torch

    where = f"{group.packed.path}: {group.name}"
    needed = ("absmax", "quant_map", "nested_absmax", "nested_quant_map") if group.nested else ("absmax", "quant_map")
    for suffix in needed:
        if suffix not in group.parts:
            raise CheckpointError(f"{where}: quant state is missing '{group.name}.{suffix}'")
    if not group.nested and "nested_absmax" in group.parts:
        raise CheckpointError(f"{where}: has nested_absmax but its quant state JSON has no nested_blocksize")
    n = math.prod(group.shape)
    if group.packed.nbytes != (n + 1) // 2:
        raise CheckpointError(f"{where}: {group.packed.nbytes} packed bytes do not hold shape {list(group.shape)} ({(n + 1) // 2} expected)")
    n_blocks = -(-n // group.meta["blocksize"])
    absmax = group.parts["absmax"]
    if math.prod(absmax.shape) != n_blocks:
        raise CheckpointError(f"{where}: absmax has {math.prod(absmax.shape)} entries, {n_blocks} expected")
    if group.nested:
        if absmax.dtype != "U8":
            raise CheckpointError(f"{where}: nested absmax must be U8, not {absmax.dtype}")
        n_nested = -(-n_blocks // group.meta["nested_blocksize"])
        nested = group.parts["nested_absmax"]
        if math.prod(nested.shape) != n_nested or nested.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{where}: nested_absmax has {math.prod(nested.shape)} {nested.dtype} entries, {n_nested} floats expected")
        if math.prod(group.parts["nested_quant_map"].shape) != 256:
            raise CheckpointError(f"{where}: nested_quant_map has {math.prod(group.parts['nested_quant_map'].shape)} entries, 256 expected")
    elif absmax.dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{where}: absmax must be floating point without a nested state, not {absmax.dtype}")
    quant_map = group.parts["quant_map"]
    from .quant_state import matches_canonical

    if quant_map.dtype not in FLOAT_DTYPES or not matches_canonical(group.meta["quant_type"], reader.tensor(quant_map).to(torch.float32)):
        raise CheckpointError(f"{where}: quant_map is not bitsandbytes' {group.meta['quant_type']} table")


def _detect_unsupported(tensors: dict[str, TensorInfo], folder: Path) -> None:
    for key, info in tensors.items():
        if key.endswith((".SCB", ".weight_format")):
            raise CheckpointError(
                f"{info.path}: '{key}' marks an 8-bit bitsandbytes (LLM.int8) checkpoint; "
                "nf4convert converts 4-bit (NF4/FP4) checkpoints only"
            )


def read_config(folder: Path) -> dict | None:
    path = folder / "config.json"
    if not path.exists():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"{path}: not valid JSON") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return config


def dense_config(config: dict, dtype: str) -> dict:
    """config.json for the dense model: quantization_config gone everywhere, the dtype recorded."""

    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "quantization_config"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    result = strip(config)
    result["torch_dtype"] = dtype
    result["dtype"] = dtype
    return result


def other_files(folder: Path) -> list[Path]:
    """Files to carry over unchanged (relative paths): everything but weights, indexes and caches."""
    kept = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if any(part in SKIPPED_DIRS for part in relative.parts) or not path.is_file():
            continue
        if relative.as_posix() == "config.json" or any(fnmatch.fnmatch(path.name, p) for p in SKIPPED_FILES):
            continue
        kept.append(relative)
    return kept


def make_plan(folder: Path, *, dtype: str = "auto", max_shard_size: int = 5 * 10**9, reader: TensorReader | None = None) -> Plan:
    """Plan the conversion of the checkpoint in ``folder``; raises CheckpointError on bad input."""
    own_reader = reader is None
    reader = reader or TensorReader()
    try:
        tensors = read_tensors(folder)
        _detect_unsupported(tensors, folder)
        groups = _quant_groups(tensors, reader)
    finally:
        if own_reader:
            reader.close()
    if not groups:
        raise CheckpointError(f"{folder}: no 4-bit bitsandbytes weights (no '*.quant_state.bitsandbytes__nf4/fp4' tensors): nothing to convert")
    if DTYPE_CHOICES.get(dtype, "?") == "?":
        raise ValueError(f"dtype {dtype!r} is not one of auto, bf16, fp16, fp32")
    out_dtype = DTYPE_CHOICES[dtype] or Counter(g.meta["dtype"] for g in groups).most_common(1)[0][0]
    out_code = TORCH_TO_SAFETENSORS[out_dtype]
    out_size = DTYPES[out_code][1]

    by_packed = {group.packed.name: group for group in groups}
    consumed = {key for group in groups for key in group.source_keys}
    planned = []
    for info in sorted(tensors.values(), key=lambda t: (str(t.path), t.begin)):
        if info.name in by_packed:
            group = by_packed[info.name]
            planned.append(PlannedTensor(OutputTensor(group.name, out_code, group.shape, math.prod(group.shape) * out_size), group))
        elif info.name not in consumed:
            # Every other floating tensor takes the output dtype, so the checkpoint is uniformly that dtype.
            code = out_code if info.dtype in {"F64", "F32", "F16", "BF16"} else info.dtype
            planned.append(PlannedTensor(OutputTensor(info.name, code, info.shape, math.prod(info.shape) * DTYPES[code][1]), info))

    shards: list[Shard] = [Shard("")]
    for tensor in planned:
        if shards[-1].tensors and shards[-1].nbytes + tensor.output.nbytes > max_shard_size:
            shards.append(Shard(""))
        shards[-1].tensors.append(tensor)
    for index, shard in enumerate(shards, 1):
        shard.filename = "model.safetensors" if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
    config = read_config(folder)
    return Plan(folder, out_dtype, shards, groups, tensors, other_files(folder), config)


def index_json(plan: Plan) -> dict:
    """model.safetensors.index.json for a sharded output, as transformers writes it."""
    weight_map = {t.output.name: shard.filename for shard in plan.shards for t in shard.tensors}
    return {"metadata": {"total_size": plan.tensor_bytes}, "weight_map": dict(sorted(weight_map.items()))}
