"""What becomes what: every output tensor with its recipe, dtype, shape, size, shard and offset, from headers alone.

A plan is plain data. Each output tensor has a *recipe* (``kinds/``): the source tensors it reads and the kind of
operation that makes it. The pipeline executes recipes; verify recomputes them with the reference libraries. The only
tensor data read while planning are the quant states' tiny JSON and code tables, the nested absmax (one float per
256 blocks) and the 8-bit format flags and row scales, each checked: a plan of a large checkpoint takes a moment,
and it knows the exact output size before anything is written.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .dtypes import DTYPES, OUTPUT_DTYPES, DType
from .errors import CheckpointError
from .files import carried_files, inside
from .formats.base import all_formats, config_problem, families
from .kinds.base import Added, PlannedTensor, Planning, Recipe, SideFiles, all_kinds
from .model.config import dense_config, quantization_config, read_config
from .safetensors_io.read import TensorInfo, TensorReader, read_tensors
from .sizes import DEFAULT_SHARD_BYTES

if TYPE_CHECKING:
    from .adapters.lora import Adapter
    from .kinds.merge_lora import Merged

# Every kind's and every format's module, imported with the planner on the thread that imports it: the CPU route's
# worker processes, forked before a plan is made, unpickle the kinds' computations without importing anything, and the
# model card, written on a side thread, reads the formats' texts without importing anything either.
all_kinds()
all_formats()


def may_exceed(tensor: PlannedTensor) -> bool:
    """Whether the output dtype may not hold the tensor's values: fp16 (largest 65504) made from a wider-ranged source
    (each kind says: ``Recipe.exceeds_fp16``). Such tensors are checked for ±inf as they are written, and named in a
    warning."""
    return tensor.dtype == "F16" and tensor.recipe.exceeds_fp16()


@dataclass
class Shard:
    filename: str
    tensors: list[PlannedTensor] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class Plan:
    folder: Path  # the source checkpoint
    dtype: DType  # of every floating output tensor
    shards: list[Shard]
    source_tensors: dict[str, TensorInfo]
    side_files: list[Path]  # carried over unchanged, relative to ``folder``
    config: dict | None  # config.json as the output has it
    card: Path | None  # the source's model card (README.md), which the output's is written from
    merged: Merged | None = None  # what merging an adapter did beyond the tensors, if one was merged
    side_bytes: int = 0  # the side files' and the card's bytes, when planned
    added_files: dict[Path, Added] = field(default_factory=dict)  # files a kind adds, relative to the output

    @property
    def tensors(self) -> list[PlannedTensor]:
        return [tensor for shard in self.shards for tensor in shard.tensors]

    @property
    def tensor_bytes(self) -> int:
        return sum(shard.nbytes for shard in self.shards)

    @property
    def output_bytes(self) -> int:
        """Every byte the output takes: its tensors, side files and card (what its disk must hold)."""
        return self.tensor_bytes + self.side_bytes

    @property
    def kinds(self) -> dict[str, int]:
        """How many tensors each kind makes, by the kind's label ({"copied": 11, "dequantized from 4-bit": 28})."""
        return dict(sorted(Counter(tensor.recipe.label for tensor in self.tensors).items()))

    @property
    def n_dequantized(self) -> int:
        """Tensors made by a recipe other than a plain copy."""
        return sum(not tensor.recipe.plain for tensor in self.tensors)

    @property
    def source_formats(self) -> list[str]:
        """The source formats the weights came in, as the model card names them."""
        return sorted({tensor.recipe.innermost().source_format for tensor in self.tensors} - {None})


def _refuse_unclaimed(planning: Planning) -> None:
    """CheckpointError for a checkpoint of which no format claimed a weight: nothing to convert."""
    if any(recipe.innermost().format is not None for recipe in planning.recipes.values()):
        return
    raise CheckpointError(
        f"{planning.folder}: no quantized weights of a format nf4convert reads ({families()}): nothing to convert"
    )


def _in_file_order(planning: Planning) -> dict[str, Recipe]:
    """The recipes in the order of their anchors in the source files (so reads stay sequential)."""
    tensors = planning.tensors
    position = {
        name: index
        for index, name in enumerate(sorted(tensors, key=lambda n: (str(tensors[n].path), tensors[n].begin)))
    }
    return {anchor: planning.recipes[anchor] for anchor in sorted(planning.recipes, key=position.__getitem__)}


def _auto_dtype(recipes: list[Recipe], config: dict | None) -> DType:
    """``--dtype auto``: the dtype most 4-bit weights were quantized from (their quant state says), else the
    config's (8-bit checkpoints), else that of most plain floating tensors."""
    quantized_from = [r.innermost().quantized_from for r in recipes if r.innermost().quantized_from is not None]
    if quantized_from:
        return OUTPUT_DTYPES[Counter(quantized_from).most_common(1)[0][0]]
    for key in ("dtype", "torch_dtype"):
        if isinstance(config, dict) and isinstance(config.get(key), str) and config[key] in OUTPUT_DTYPES:
            return OUTPUT_DTYPES[config[key]]
    plain = [r.plain_dtype for r in recipes if r.plain_dtype in OUTPUT_DTYPES]
    return OUTPUT_DTYPES[Counter(plain).most_common(1)[0][0] if plain else "float32"]


def make_plan(
    folder: Path,
    *,
    dtype: DType | None = None,
    max_shard_size: int = DEFAULT_SHARD_BYTES,
    reader: TensorReader | None = None,
    adapter: Path | Adapter | None = None,
    keep_non_finite: bool = False,
) -> Plan:
    """Plan the conversion of the checkpoint in ``folder`` (with the peft LoRA adapter ``adapter``, its folder or as
    read, ``hub.sources.Resolved.loaded_adapter``, merged in): every
    registered kind plans from the headers in its order (``kinds/base.py``), then once the dtype is chosen.
    ``keep_non_finite``: NaN or ±inf values a merge makes are kept (listed on its recipes' ``non_finite``), not
    refused when the tensor is made.

    Raises:
        CheckpointError: a file is missing, truncated or corrupt, the checkpoint has no weights of a registered
            format, or the adapter is not a LoRA adapter that fits the checkpoint.
    ``dtype``: of every floating output tensor (None: auto, the dtype the weights were quantized from); shards of at
    most ``max_shard_size`` bytes (options.py parses both). A refusal of a checkpoint whose config.json says why it
    has nothing to convert (a format's ``config_problem``) says that reason instead.
    """
    read: dict = {}  # config.json, once read
    try:
        return _plan(folder, dtype, max_shard_size, reader, adapter, keep_non_finite, read)
    except CheckpointError as error:
        worded = _worded(error, folder, read)
        if worded is error:
            raise
        raise worded from None


def _worded(error: CheckpointError, folder: Path, read: dict) -> CheckpointError:
    """A plan's refusal with the reason its config.json gives where a format finds one (a model saved with
    ``llm_int8_has_fp16_weight`` has no 8-bit weights: that, not their absence, is what the user needs to know)."""
    if "config" not in read:  # the refusal came first
        try:
            read["config"] = read_config(folder)
        except CheckpointError:
            return error
    config = read["config"]
    reason = config_problem(config) if config is not None else None
    return CheckpointError(f"{folder}: {reason}") if reason is not None else error


def _plan(folder, dtype, max_shard_size, reader, adapter, keep_non_finite, read: dict) -> Plan:
    chosen = dtype
    kinds = all_kinds().values()
    own_reader = reader is None
    reader = reader or TensorReader()
    try:
        tensors = read_tensors(folder)
        read["config"] = config = read_config(folder)
        to_merge = Path(adapter) if isinstance(adapter, (str, os.PathLike)) else adapter
        planning = Planning(folder, tensors, reader, config, quantization_config(config), to_merge)
        for kind in kinds:
            kind.plan_source(planning)
        _refuse_unclaimed(planning)
        planning.recipes = _in_file_order(planning)
    finally:
        if own_reader:
            reader.close()
    planning.dtype = chosen = chosen or _auto_dtype(list(planning.recipes.values()), config)
    planning.keep_non_finite = keep_non_finite
    for kind in kinds:
        kind.plan_output(planning)
    recipes = planning.recipes.values()

    shards: list[list[tuple]] = [[]]
    shard_bytes = 0
    for recipe in recipes:
        name, code, shape = recipe.output(chosen)
        nbytes = math.prod(shape) * DTYPES[code].itemsize
        if shards[-1] and shard_bytes + nbytes > max_shard_size:
            shards.append([])
            shard_bytes = 0
        shards[-1].append((name, code, shape, nbytes, shard_bytes, recipe))
        shard_bytes += nbytes
    planned = []
    for index, entries in enumerate(shards, 1):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        planned.append(Shard(filename, [PlannedTensor(n, c, s, b, filename, o, r) for n, c, s, b, o, r in entries]))
    card = folder / "README.md"
    if card.is_file():
        inside(folder, "README.md")
    files = SideFiles(carried_files(folder))
    for kind in kinds:
        files = kind.plan_files(planning, files)
    card = card if card.is_file() else None
    side_bytes = sum((folder / path).stat().st_size for path in files.carried) + (card.stat().st_size if card else 0)
    side_bytes += sum(added.path.stat().st_size for added in files.added.values())
    config = config and dense_config(config, chosen)
    for kind in kinds if config else ():
        config = kind.plan_config(planning, config)
    return Plan(
        folder,
        chosen,
        planned,
        tensors,
        files.carried,
        config,
        card,
        planning.merged,
        side_bytes,
        files.added,
    )
