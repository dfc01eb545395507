"""What becomes what: every output tensor with its recipe, dtype, shape, size, shard and offset, from headers alone.

A plan is plain data. Each output tensor has a *recipe*: the source tensors it reads and the
operation that makes it (:class:`Copy` a tensor, cast to the output dtype where it is floating;
:class:`Dequantize4bit` a bitsandbytes 4-bit weight; :class:`Dequantize8bit` an LLM.int8 weight;
:class:`Transpose` such a weight of a Conv1D layer, which transformers quantized transposed; :class:`MergeLora`
a LoRA adapter's change merged into another recipe's tensor).
``stream`` executes recipes, ``verification`` recomputes them with the reference libraries. The only
tensor data read while planning are the quant states' tiny JSON and code tables, the nested absmax (one
float per 256 blocks) and the 8-bit format flags and row scales, each checked, so a plan for a 70B checkpoint takes a moment, and it knows the exact output size before anything is
written.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

from .files import ADAPTER_FILES, LOADED_WEIGHT_FILES, NAMED_WEIGHT_FILES, inside
from .safetensors_io.read import TensorInfo, TensorReader, read_tensors
from .strict_json import shown, strict_json
from .dtypes import DTYPES, OUTPUT_DTYPES, DType, output_dtype
from .errors import ArgumentError, CheckpointError
from .formats import bnb4, bnb8, conv1d, peft_lora

# Files a converted checkpoint must not carry over: the old weights, their indexes, a peft adapter's own files (an
# adapter beside the weights is not part of the dense model), VCS data and download leftovers.
SKIPPED_FILES = (*LOADED_WEIGHT_FILES, *NAMED_WEIGHT_FILES, *ADAPTER_FILES, ".gitattributes", "*.lock", "*.incomplete")
SKIPPED_DIRS = {".cache", ".git", ".huggingface", "__pycache__"}
# Files the conversion writes anew instead of carrying over (output.write_side_files): the dense config, the model card.
WRITTEN_ANEW = ("config.json", "README.md")
DEFAULT_SHARD_SIZE = "5GB"  # the one default, as transformers spells it (the CLI and the API show this)
# Every source tensor whose bytes a plan reads, by name (each format's own list; the rest it knows from headers): a Hub
# dry run fetches just these (hub.py). A reader given a headers-only copy refuses any other bytes, so a format that
# reads more without saying so here fails that dry run in one line, never plans from zeros.
PLAN_READS = re.compile("|".join(f"(?:{reads.pattern})" for reads in (bnb4.PLAN_READS, bnb8.PLAN_READS)))


@dataclass(frozen=True)
class Copy:
    """The source tensor's bytes, cast to the output tensor's dtype where they differ."""

    label: ClassVar[str] = "copied"
    source: TensorInfo

    @property
    def sources(self) -> tuple:
        return (self.source,)


@dataclass(frozen=True)
class Dequantize4bit:
    """A bitsandbytes 4-bit weight, dequantized (bitsandbytes' CUDA arithmetic) to the output dtype."""

    label: ClassVar[str] = "dequantized from 4-bit"
    weight: bnb4.Weight4bit

    @property
    def sources(self) -> tuple:
        return self.weight.sources


@dataclass(frozen=True)
class Dequantize8bit:
    """A bitsandbytes 8-bit (LLM.int8) weight: int8 codes times their row's scale over 127, in the output dtype."""

    label: ClassVar[str] = "dequantized from 8-bit"
    weight: bnb8.Weight8bit

    @property
    def sources(self) -> tuple:
        return self.weight.sources


@dataclass(frozen=True)
class Transpose:
    """A quantized weight of a transformers ``Conv1D`` layer (GPT-2 and its kin): transformers quantized it
    transposed, (out, in), and the dense model holds it (in, out) (``formats/conv1d.py``)."""

    label: ClassVar[str] = "dequantized and transposed (Conv1D)"
    base: "Dequantize4bit | Dequantize8bit"

    @property
    def sources(self) -> tuple:
        return self.base.sources


@dataclass(frozen=True)
class MergeLora:
    """Another recipe's tensor with a peft LoRA adapter's change merged in, bit for bit as peft merges it."""

    label: ClassVar[str] = "merged with the adapter"
    base: "Copy | Dequantize4bit | Dequantize8bit | Transpose"
    target: peft_lora.LoraTarget
    adapter: peft_lora.Adapter = field(compare=False, repr=False)  # the whole adapter (verify rebuilds its module)

    @property
    def sources(self) -> tuple:
        return (*self.base.sources, *self.target.tensors.values())


Recipe = Copy | Dequantize4bit | Dequantize8bit | Transpose | MergeLora
QUANTIZED = (Dequantize4bit, Dequantize8bit)


def innermost(recipe: Recipe) -> "Copy | Dequantize4bit | Dequantize8bit":
    """What a recipe starts from: a copied or dequantized tensor, under any transpose or merge."""
    while isinstance(recipe, (Transpose, MergeLora)):
        recipe = recipe.base
    return recipe


def may_exceed(tensor: "PlannedTensor") -> bool:
    """Whether the output dtype may not hold the tensor's values: fp16 (largest 65504) made from a wider-ranged source
    (a bf16/fp32 tensor, a 4-bit weight quantized from one, an 8-bit weight's fp32 scales), from a double-quantized
    4-bit weight (its blocks' rebuilt scale, nested code * nested absmax + offset, can exceed their own absmax: an fp16
    weight at 65504 can come back as inf, from bitsandbytes too) or with an adapter's change added. Such tensors are
    checked for ±inf as they are written (stream._Pipeline), and named in a warning."""
    if tensor.dtype != "F16":
        return False
    if isinstance(tensor.recipe, MergeLora):
        return True
    base = innermost(tensor.recipe)
    if isinstance(base, Copy):
        return base.source.dtype in ("BF16", "F32", "F64")
    if isinstance(base, Dequantize4bit):
        return base.weight.meta.get("dtype") != "float16" or base.weight.nested
    return True


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor: what it is, where it goes (``offset`` from the start of its shard's data), how it is made."""

    name: str
    dtype: str  # safetensors' name
    shape: tuple
    nbytes: int
    shard: str
    offset: int
    recipe: Recipe


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
    adapter: peft_lora.Adapter | None = None  # merged into the output
    side_bytes: int = 0  # the side files' and the card's bytes, when planned

    @property
    def tensors(self) -> list[PlannedTensor]:
        return [tensor for shard in self.shards for tensor in shard.tensors]

    @property
    def tensor_bytes(self) -> int:
        return sum(shard.nbytes for shard in self.shards)

    @property
    def n_dequantized(self) -> int:
        return sum(not isinstance(tensor.recipe, Copy) for tensor in self.tensors)

    @property
    def source_formats(self) -> list[str]:
        """The bitsandbytes formats the weights came in, as the model card names them."""
        formats = set()
        for tensor in self.tensors:
            recipe = innermost(tensor.recipe)
            if isinstance(recipe, Dequantize4bit):
                formats.add(f"bnb-4bit {recipe.weight.quant_type}")
            elif isinstance(recipe, Dequantize8bit):
                formats.add("bnb-8bit")
        return sorted(formats)


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB', '1.5GB' or a number of bytes -> bytes (decimal units like transformers)."""
    from decimal import Decimal, InvalidOperation

    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
        value = str(text).strip().upper()
        number = value.rstrip("KMGTIB")
        try:
            amount = Decimal(number)  # exact: no float rounding of a large byte count
            bytes_ = amount * units[value[len(number) :].strip()] if amount.is_finite() else None
        except (InvalidOperation, KeyError, ValueError):
            bytes_ = None
        if bytes_ is None or bytes_ != bytes_.to_integral_value():  # '1.5' bytes is no size, '1.5GB' is
            raise ArgumentError(f"max_shard_size {text!r} is not like '5GB', '500MB' or a whole number of bytes",
                                option="max_shard_size")  # fmt: skip
        size = int(bytes_)
    if size <= 0 or size >= 2**63:
        raise ArgumentError(f"max_shard_size {text!r} must be positive and below 2**63 bytes", option="max_shard_size")
    return size


def read_config(folder: Path) -> dict | None:
    path = folder / "config.json"
    if not path.exists() and not path.is_symlink():  # a dangling link is a config that cannot be read, not none
        return None
    inside(folder, "config.json")
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from None
    config = strict_json(raw, str(path))
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return config


def dense_config(config: dict, dtype: DType) -> dict:
    """config.json for the dense model: quantization_config gone everywhere, the dtype recorded."""

    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "quantization_config"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    result = strip(config)
    result["torch_dtype"] = dtype.name
    result["dtype"] = dtype.name
    return result


def side_files(folder: Path) -> list[Path]:
    """Files to carry over unchanged (relative paths): everything but weights, indexes, caches, the config and the
    model card (both written anew)."""
    import os

    def unreadable(error: OSError):  # rglob would skip such a folder without a word
        raise CheckpointError(f"{error.filename}: cannot be read ({error.strerror or error}); its files would be missing from "
                              "the output") from None  # fmt: skip

    kept = []
    for root, dirs, files in os.walk(folder, onerror=unreadable):  # a link to a folder is not followed: not carried
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in files:
            path = Path(root) / name
            relative = path.relative_to(folder)
            if relative.as_posix() in WRITTEN_ANEW or any(fnmatch.fnmatch(name, p) for p in SKIPPED_FILES):
                continue
            inside(folder, relative.as_posix())  # a link out of the folder is never copied into the output
            if not path.is_file():  # found now: a file missing from the output would go unnoticed (verify too)
                if path.is_symlink() and not path.exists():
                    raise CheckpointError(f"{path}: is a link to {os.readlink(path)}, which does not exist (an interrupted "
                                          "download?); it would be missing from the output")  # fmt: skip
                raise CheckpointError(f"{path}: is not a regular file (a pipe, socket or device); it cannot be carried "
                                      "into the output")  # fmt: skip
            if not os.access(path, os.R_OK):  # found now, not as the output's write failing after every tensor
                raise CheckpointError(f"{path}: cannot be read (permission denied); it is carried over into the output")
            kept.append(relative)
    return sorted(kept)


def _recipes(folder: Path, tensors: dict[str, TensorInfo], reader: TensorReader, config: dict | None) -> list[Recipe]:
    """One recipe per output tensor, in the order of the source files (so reads stay sequential)."""
    weights4, weights8 = bnb4.find_weights(tensors, reader), bnb8.find_weights(tensors, reader)
    for name in sorted({weight.packed.name for weight in weights4} & {weight.weight.name for weight in weights8}):
        raise CheckpointError(f"{tensors[name].path}: tensor {shown(name)} has both a 4-bit quant state and an 8-bit SCB; "
                              "it is one or the other")  # fmt: skip
    quantization = _quantization_config(config)
    bnb4.unclaimed_packed(tensors, weights4, quantization)
    bnb8.unclaimed_int8(tensors, weights8, quantization)
    quantized = {weight.packed.name: Dequantize4bit(weight) for weight in weights4}
    quantized.update({weight.weight.name: Dequantize8bit(weight) for weight in weights8})
    for name, recipe in quantized.items():
        if conv1d.is_conv1d_weight(recipe.weight.name, config):
            quantized[name] = Transpose(recipe)
    if not quantized:
        raise CheckpointError(f"{folder}: no bitsandbytes weights (no '*.quant_state.bitsandbytes__nf4/fp4' "
                              "or 8-bit '*.SCB' tensors): nothing to convert")  # fmt: skip
    consumed = {source.name for recipe in quantized.values() for source in recipe.sources}
    recipes: list[Recipe] = []
    for info in sorted(tensors.values(), key=lambda t: (str(t.path), t.begin)):
        if info.name in quantized:
            recipes.append(quantized[info.name])
        elif info.name not in consumed:
            recipes.append(Copy(info))
    return recipes


def _quantization_config(config) -> dict | None:
    """config.json's quantization_config (a nested model config's, for a multimodal model), if any."""
    if not isinstance(config, dict):
        return None
    if isinstance(config.get("quantization_config"), dict):
        return config["quantization_config"]
    nested = (_quantization_config(value) for value in config.values() if isinstance(value, dict))
    return next((found for found in nested if found is not None), None)


def _auto_dtype(recipes: list[Recipe], config: dict | None) -> DType:
    """``--dtype auto``: the dtype most 4-bit weights were quantized from (their quant state says), else the
    config's (8-bit checkpoints), else that of most plain floating tensors."""
    quantized_from = [innermost(r).weight.meta["dtype"] for r in recipes if isinstance(innermost(r), Dequantize4bit)]
    if quantized_from:
        return OUTPUT_DTYPES[Counter(quantized_from).most_common(1)[0][0]]
    for key in ("dtype", "torch_dtype"):
        if isinstance(config, dict) and isinstance(config.get(key), str) and config[key] in OUTPUT_DTYPES:
            return OUTPUT_DTYPES[config[key]]
    plain = [DTYPES[r.source.dtype].name for r in recipes if isinstance(r, Copy) and DTYPES[r.source.dtype].name in OUTPUT_DTYPES]
    return OUTPUT_DTYPES[Counter(plain).most_common(1)[0][0] if plain else "float32"]


def _tied(config: dict) -> bool:
    """Whether the model (or its text model) ties lm_head to the input embeddings; transformers' default is True."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))


def _vocab_size(config: dict):
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return config.get("vocab_size", text.get("vocab_size"))


def _output(recipe: Recipe, dtype: DType) -> tuple[str, str, tuple]:
    """(name, safetensors dtype, shape) of the tensor a recipe makes."""
    if isinstance(recipe, MergeLora):
        return _output(recipe.base, dtype)
    if isinstance(recipe, Transpose):
        name, code, shape = _output(recipe.base, dtype)
        return name, code, tuple(reversed(shape))
    if isinstance(recipe, QUANTIZED):
        return recipe.weight.name, dtype.code, recipe.weight.shape
    source = recipe.source
    # Every floating tensor takes the output dtype, so the checkpoint is uniformly that dtype.
    return source.name, dtype.code if DTYPES[source.dtype].cast else source.dtype, source.shape


def _merge_adapter(recipes: list[Recipe], adapter_folder: Path, dtype: DType,
                   config: dict | None) -> tuple[list[Recipe], peft_lora.Adapter]:  # fmt: skip
    """Each recipe whose tensor the adapter changes becomes a MergeLora around it; the adapter is checked first."""
    adapter = peft_lora.load_adapter(adapter_folder)
    shapes = {name: shape for name, _, shape in (_output(recipe, dtype) for recipe in recipes)}
    config = config if isinstance(config, dict) else {}
    peft_lora.validate(adapter, shapes, config=config)
    if _tied(config) and any(name.endswith("lm_head.weight") for name in adapter.targets):
        # peft unties the head to merge it; transformers would tie it again on load and drop the change
        raise CheckpointError(f"{adapter.path}: changes lm_head, which the base ties to its input embeddings "
                              "(tie_word_embeddings): not mergeable into a checkpoint that stays tied")  # fmt: skip
    if _tied(config):
        # modules_to_save replacing the input embeddings: peft swaps in the saved copy, the head keeps the old one,
        # and merge_and_unload unties them; a checkpoint that stays tied would give the head the new one
        vocab = _vocab_size(config)
        for name, target in adapter.targets.items():
            shape = shapes.get(name, ())
            if target.kind != "replace" or len(shape) != 2:
                continue
            if shape[0] == vocab if vocab else name.endswith(("embed_tokens.weight", "wte.weight", "word_embeddings.weight")):
                raise CheckpointError(f"{adapter.path}: modules_to_save replaces '{name}', the input embeddings, which the "
                                      "base ties to lm_head (tie_word_embeddings): peft unties them on merge and keeps "
                                      "the old head; not mergeable into a checkpoint that stays tied")  # fmt: skip
    merged = []
    for recipe in recipes:
        name = _output(recipe, dtype)[0]
        target = adapter.targets.get(name)
        if target is not None and not DTYPES[_output(recipe, dtype)[1]].cast:
            raise CheckpointError(f"{adapter.path}: changes '{name}', which is not a floating tensor")
        merged.append(MergeLora(recipe, target, adapter) if target is not None else recipe)
    return merged, adapter


def make_plan(folder: Path, *, dtype: str = "auto", max_shard_size: str | int = DEFAULT_SHARD_SIZE,
              reader: TensorReader | None = None, adapter: Path | None = None) -> Plan:  # fmt: skip
    """Plan the conversion of the checkpoint in ``folder`` (with the peft LoRA adapter in ``adapter`` merged in).

    Raises:
        CheckpointError: a file is missing, truncated or corrupt, the checkpoint has no bitsandbytes weights, or
            the adapter is not a LoRA adapter that fits the checkpoint.
        ArgumentError: ``dtype`` is not auto, bf16, fp16, fp32 (or torch's names).
    """
    chosen = output_dtype(dtype)
    max_shard_size = parse_size(max_shard_size)
    own_reader = reader is None
    reader = reader or TensorReader()
    try:
        tensors = read_tensors(folder)
        config = read_config(folder)
        recipes = _recipes(folder, tensors, reader, config)
    finally:
        if own_reader:
            reader.close()
    chosen = chosen or _auto_dtype(recipes, config)
    merged_adapter = None
    if adapter is not None:
        recipes, merged_adapter = _merge_adapter(recipes, Path(adapter), chosen, config)

    shards: list[list[tuple]] = [[]]
    shard_bytes = 0
    for recipe in recipes:
        name, code, shape = _output(recipe, chosen)
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
    carried = side_files(folder)
    card = card if card.is_file() else None
    side_bytes = sum((folder / path).stat().st_size for path in carried) + (card.stat().st_size if card else 0)
    return Plan(folder, chosen, planned, tensors, carried, config and dense_config(config, chosen), card, merged_adapter,
                side_bytes)  # fmt: skip
