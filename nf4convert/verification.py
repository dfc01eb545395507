"""Check a converted checkpoint against its source with the reference libraries, bit for bit.

verify is stream's sibling: it re-plans the source and recomputes every recipe with bitsandbytes and
peft (never with our kernels or merge code), then compares the output's bytes. Every source tensor must
be there, no quantization key or config may remain, and every floating tensor must be of the output's
one dtype; the weight files must be laid out as transformers finds them (model.safetensors, or shards and
their exact index), and every file the conversion carries over must be there with the source's bytes.
The 4-bit reference on the CPU is ``reference.py``: bitsandbytes' CUDA arithmetic from bitsandbytes' own
parts, because its native CPU op differs from its CUDA kernels on some CPUs.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from .files import ADAPTER_FILES, INDEX_NAME, LOADED_WEIGHT_FILES, NAMED_WEIGHT_FILES
from .safetensors_io.read import TensorInfo, TensorReader, read_index, read_tensors
from .strict_json import strict_json
from .dtypes import DTYPES, OUTPUT_DTYPES
from .errors import ArgumentError, CheckpointError, DependencyError, SourceNotFoundError
from .paths import expanded
from .skeleton import meta_model
from .formats import bnb4, bnb8
from .plan import QUANTIZED, Copy, Dequantize4bit, Dequantize8bit, MergeLora, PlannedTensor, Transpose, innermost, make_plan


@dataclass
class VerifyReport:
    output: Path
    checked: int = 0
    dequantized: int = 0  # tensors recomputed by the reference libraries (not plain copies)
    merged: int = 0  # of which an adapter's change was merged by peft
    device: str = "cpu"
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # checks that could not run (not problems: the weights may be right)

    @property
    def ok(self) -> bool:
        return not self.problems


def _bits(tensor):
    import torch

    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(-1).view(integer)


def _reference_4bit(tensor: PlannedTensor, reader: TensorReader, device, context: "_Context"):
    """bitsandbytes' CUDA result for a 4-bit weight: bitsandbytes itself on a GPU, its exact twin on the CPU."""
    from .reference import dequantize_4bit, quant_state_from_tensors

    weight = tensor.recipe.weight
    parts = {info.name: reader.tensor(info) for info in weight.parts.values()}
    state = quant_state_from_tensors(parts, device, file=weight.packed.path)
    packed = reader.tensor(weight.packed)
    return dequantize_4bit(packed, state, dtype=DTYPES[tensor.dtype].torch, device=device)


def _reference_8bit(tensor: PlannedTensor, reader: TensorReader, device, context: "_Context"):
    weight = tensor.recipe.weight
    codes, scb = reader.tensor(weight.weight).to(device), reader.tensor(weight.scb).to(device)
    return bnb8.reference_dequantize(codes, scb, DTYPES[tensor.dtype].torch)


def _reference_transpose(tensor: PlannedTensor, reader: TensorReader, device, context: "_Context"):
    """A Conv1D weight: the reference of the weight as quantized, (out, in), transposed."""
    import dataclasses

    base = dataclasses.replace(tensor, recipe=tensor.recipe.base, shape=tuple(reversed(tensor.shape)))
    return REFERENCES[type(base.recipe)][0](base, reader, device, context).reshape(base.shape).T.contiguous()


def _reference_copy(tensor: PlannedTensor, reader: TensorReader, device, context: "_Context"):
    """The source tensor, cast by torch where the dtype changes; a NaN then as CUDA's canonical NaN (all bits but the
    sign), as the converter casts on every route (torch's own NaN bits depend on the CPU)."""
    from .reference import canonical_nans

    source = reader.tensor(tensor.recipe.source)
    cast = source.to(DTYPES[tensor.dtype].torch)
    if cast.dtype != source.dtype and cast.is_floating_point():
        cast = canonical_nans(cast.contiguous())  # a cast is a new tensor: the source's bytes stay as read
    return cast


def _skeleton_module(module: str, adapter, device, dtype, references: dict, layer_class):
    """A stand-in for one module of the base model holding ``references`` (its tensors, by full name): the layer
    class the model has there (``layer_class``, read from transformers' own model on the meta device: Linear,
    Conv1D or Embedding, which decides what peft does), or a plain holder for a modules_to_save module. peft
    then does all of the merging."""
    import torch

    lora = next((t for t in adapter.targets.values() if t.module == module and t.kind in ("linear", "embedding")), None)
    params = {name.rpartition(".")[2]: value for name, value in references.items()}
    # The layer transformers' model has there, whatever kind of LoRA tensors the adapter holds: peft loads those of
    # the kind its layer calls for only, so a mismatch shows as a weight peft leaves unchanged.
    embedding = lora is not None and (lora.kind == "embedding" if layer_class is None else issubclass(layer_class, torch.nn.Embedding))
    if lora is not None:  # the base weight's shape, (out, in) / (rows, columns), from the LoRA factors of either kind
        first, second = (lora.tensors[role] for role in (("lora_embedding_A", "lora_embedding_B") if lora.kind == "embedding"
                                                          else ("lora_B", "lora_A")))  # fmt: skip
        dense = (first.shape[1], second.shape[0]) if lora.kind == "embedding" else (first.shape[0], second.shape[1])
        dense = tuple(params["weight"].shape) if "weight" in params else dense
    if embedding:
        layer = torch.nn.Embedding(*dense, device="meta")
    elif lora is not None and lora.kind == "embedding":  # on a Linear/Conv1D of the model
        layer = torch.nn.Linear(dense[1], dense[0], bias="bias" in params, device="meta")
    elif lora is not None and layer_class is not None and layer_class.__name__ == "Conv1D":
        layer = layer_class(lora.tensors["lora_B"].shape[0], lora.tensors["lora_A"].shape[1])
    elif lora is not None:
        shape = (lora.tensors["lora_A"].shape[1], lora.tensors["lora_B"].shape[0])
        layer = torch.nn.Linear(*shape, bias="bias" in params, device="meta")
    else:
        layer = torch.nn.Module()
    for name, value in params.items():
        setattr(layer, name, torch.nn.Parameter(value, requires_grad=False))
    if lora is not None and "weight" not in params:  # a stand-in whose weight is not checked
        if lora.kind == "embedding":
            shape = (lora.tensors["lora_embedding_A"].shape[1], lora.tensors["lora_embedding_B"].shape[0])
        else:
            shape = (lora.tensors["lora_A"].shape[1], lora.tensors["lora_B"].shape[0])
            shape = shape if type(layer).__name__ == "Conv1D" else shape[::-1]
        layer.weight = torch.nn.Parameter(torch.ones(shape, dtype=dtype, device=device), requires_grad=False)
    if lora is not None and lora.kind == "linear" and "bias" not in params and type(layer).__name__ == "Conv1D":
        del layer.bias  # Conv1D always has one; the base has none
        layer.bias = None
    return layer


def _reference_merge(tensor: PlannedTensor, reader: TensorReader, device, context: "_Context"):
    """peft's own merge: the tensor's module alone in a stand-in model holding the bitsandbytes reference of its
    base tensors, then ``PeftModel.from_pretrained(...).merge_and_unload()`` (what the user's route runs)."""
    import dataclasses
    import warnings

    import torch
    from peft import PeftConfig, PeftModel

    recipe = tensor.recipe
    module = tensor.name.rpartition(".")[0]
    # every tensor of this module the adapter changes (a weight and, with lora_bias, its bias) is rebuilt
    siblings = {name: t for name, t in context.planned.items() if name.rpartition(".")[0] == module}
    references = {}
    for name, sibling in siblings.items():
        base = sibling.recipe.base if isinstance(sibling.recipe, MergeLora) else sibling.recipe
        reference = REFERENCES[type(base)][0](dataclasses.replace(sibling, recipe=base), reader, device, context)
        references[name] = reference.to(device).reshape(sibling.shape)
    dtype = DTYPES[tensor.dtype].torch
    root = torch.nn.Module()
    modules = {module: _skeleton_module(module, recipe.adapter, device, dtype, references, context.module_class(module))}
    if not any(t.module == module and t.kind in ("linear", "embedding") for t in recipe.adapter.targets.values()):
        # a modules_to_save module alone: peft refuses a model with no LoRA target, so one stands beside it
        lora = next(t for t in recipe.adapter.targets.values() if t.kind in ("linear", "embedding"))
        modules[lora.module] = _skeleton_module(lora.module, recipe.adapter, device, dtype, {}, context.module_class(lora.module))
    for path, layer in modules.items():
        parent = root
        parts = path.split(".")
        for part in parts[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.add_module(parts[-1], layer)
    config = PeftConfig.from_pretrained(str(recipe.adapter.folder))
    config.task_type = None  # a bare module tree: no causal-LM wrapper
    config.inference_mode = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = PeftModel.from_pretrained(root, str(recipe.adapter.folder), config=config, torch_device=str(device))
        merged = peft_model.merge_and_unload()
    return merged.get_parameter(tensor.name).detach()


class _Context(NamedTuple):
    planned: dict  # every planned tensor by name (a merge rebuilds its module's siblings)
    module_class: Callable  # module path -> the class transformers' model has there, or None
    parameter_shape: Callable  # tensor name -> the shape transformers' model gives it, or None
    unbuilt: Callable  # -> why transformers could not build the model (once asked), or None


# The reference twin of stream.PRODUCERS: (what makes it, whom a difference is blamed on). Each reference takes
# (planned tensor, source reader, device, _Context).
REFERENCES = {
    Copy: (_reference_copy, "the source tensor"),
    Dequantize4bit: (_reference_4bit, "bitsandbytes"),
    Dequantize8bit: (_reference_8bit, "bitsandbytes"),
    Transpose: (_reference_transpose, "bitsandbytes"),
    MergeLora: (_reference_merge, "bitsandbytes + peft"),
}


def _json_text(value) -> str:
    """JSON as compared: by its text, so that 4 and 4.0, or false and 0 (equal in Python), differ as loaders see them."""
    return json.dumps(value, sort_keys=True)


def _leftovers(produced: dict[str, TensorInfo], output: Path, expected_config: dict | None) -> list[str]:
    """Quantization keys left in the output, and a config.json that is not the source's made dense (no
    quantization_config, the output's dtype recorded): what transformers would load the weights with. A source
    without a config.json gets none in its output."""
    suffixes = tuple("." + part for part in (*bnb4.PARTS, *bnb8.PARTS))
    problems = [f"{name}: a quantization key remains in the output" for name in sorted(produced)
                if bnb4.STATE_KEY.match(name) or name.endswith(suffixes)]  # fmt: skip
    config_path = output / "config.json"
    if expected_config is None:
        if config_path.exists() or config_path.is_symlink():
            problems.append("config.json: in the output, but the source has none (a conversion writes none)")
        return problems
    if not config_path.is_file():
        return [*problems, "config.json: missing from the output"]
    try:
        config = strict_json(config_path.read_bytes(), "config.json")
    except CheckpointError as error:
        return [*problems, str(error)]
    except OSError as error:
        return [*problems, f"config.json: cannot be read ({error.strerror or error})"]
    if not isinstance(config, dict):
        problems.append(f"config.json: not a JSON object (a {type(config).__name__})")
    elif "quantization_config" in json.dumps(config):
        problems.append("config.json: quantization_config remains")
    elif _json_text(config) != _json_text(expected_config):
        keys = sorted(k for k in set(config) | set(expected_config)
                      if k not in config or k not in expected_config or _json_text(config[k]) != _json_text(expected_config[k]))  # fmt: skip
        problems.append(f"config.json: differs from the source's made dense (in {', '.join(keys[:5])})")
    return problems


def _weight_file_problems(output: Path, produced: dict[str, TensorInfo]) -> list[str]:
    """The output's weight files as transformers finds them: one ``model.safetensors`` without an index, or shards
    named by ``model.safetensors.index.json``, whose ``metadata.total_size`` is their tensors' bytes, and no other
    ``.safetensors`` file (beside an index, a ``model.safetensors`` is what transformers loads). That the index maps
    exactly the output's tensors, each to the file holding it, read_tensors checked already (it refuses otherwise)."""
    import fnmatch

    files = sorted(path.name for path in output.glob("*.safetensors")
                   if not any(fnmatch.fnmatch(path.name, pattern) for pattern in FOREIGN_FILES))  # an adapter's: _unexpected_files
    index = output / INDEX_NAME
    if not index.is_file():
        others = sorted(path.name for path in output.glob("*.safetensors.index.json"))
        if others:
            return [f"{INDEX_NAME}: missing (the output's index is named {others[0]}, which transformers does not look for)"]
        if len(files) > 1:
            return [f"{INDEX_NAME}: missing; transformers loads none of the output's {len(files)} shards without it"]
        if files and files != ["model.safetensors"]:
            return [f"{files[0]}: a single-file output must be named model.safetensors (the only name transformers looks for)"]
        return []
    listed = set(read_index(output).values())
    problems = []
    if "model.safetensors" in files and listed != {"model.safetensors"}:
        problems.append("model.safetensors: beside the index; transformers loads it and ignores the shards")
    problems += [f"{name}: a .safetensors file the index does not name" for name in files if name not in listed | {"model.safetensors"}]
    raw = strict_json(index.read_bytes(), INDEX_NAME)  # read_index has read it: JSON, an object
    metadata = raw.get("metadata")
    total = sum(info.nbytes for info in produced.values())
    if not isinstance(metadata, dict):
        problems.append(f"{INDEX_NAME}: no 'metadata' object (transformers' loader reads it)")
    elif type(metadata.get("total_size")) is not int or metadata["total_size"] != total:  # 7.0e6 is not an int to loaders
        problems.append(f"{INDEX_NAME}: metadata.total_size is {metadata.get('total_size')!r}, the shards hold {total} bytes of tensors")
    return problems


# Files no conversion writes that would change how a loader reads the folder (weights in other formats, an adapter's),
# named as such in _unexpected_files; weight files and indexes at the root are _weight_file_problems'.
FOREIGN_FILES = tuple(pattern for pattern in (*ADAPTER_FILES, *LOADED_WEIGHT_FILES, *NAMED_WEIGHT_FILES)
                      if not pattern.startswith("*.safetensors"))  # fmt: skip
# What a folder may hold beside the conversion's files without changing what it is: git's and caches' own.
IGNORED_FILES = (".gitattributes",)


def _unexpected_files(plan, output: Path, produced: dict[str, TensorInfo]) -> list[str]:
    """Every file in OUT is one a conversion of this source writes, and a file, not a link: the weights, their index,
    config.json (when the source has one), the model card and the carried files. Anything else would be loaded
    beside the converted weights (a generation_config.json, a chat template, remote code, an adapter, other weights)
    or, a link, would change with what it points to. Weight files and indexes at the root are _weight_file_problems'."""
    import fnmatch
    import os

    from .plan import SKIPPED_DIRS, WRITTEN_ANEW

    written = {info.path.name for info in produced.values()} | {INDEX_NAME, *WRITTEN_ANEW}
    written |= {relative.as_posix() for relative in plan.side_files}
    theirs = ("*.safetensors",) if (output / INDEX_NAME).is_file() else ("*.safetensors", "*.safetensors.index.json")
    problems = []
    for folder, dirs, files in os.walk(output):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in sorted(files) + [d for d in dirs if (Path(folder) / d).is_symlink()]:
            path = Path(folder) / name
            relative = path.relative_to(output).as_posix()
            if path.is_symlink():
                problems.append(f"{relative}: a link (to {os.readlink(path)}); a conversion writes files, and the output "
                                "would change with what the link points to")  # fmt: skip
            elif relative in written or name in IGNORED_FILES:
                continue
            elif any(fnmatch.fnmatch(name, pattern) for pattern in FOREIGN_FILES):
                problems.append(f"{relative}: in the output, but no conversion writes it (a loader would read it instead "
                                "of, or beside, the converted weights)")  # fmt: skip
            elif "/" not in relative and any(fnmatch.fnmatch(name, pattern) for pattern in theirs):
                continue
            else:
                problems.append(f"{relative}: in the output, but not in the source, and a conversion writes no such file")
    return sorted(problems)  # by path


def _carried_problems(plan, output: Path) -> list[str]:
    """Every file the conversion carries over unchanged (plan.side_files) in the output, byte for byte.
    config.json is compared made dense (_leftovers); the model card is written anew."""
    problems = []
    for relative in plan.side_files:
        name = relative.as_posix()
        copy = output / relative
        if not copy.is_file():
            problems.append(f"{name}: carried over from the source, missing from the output")
        elif not _same_bytes(plan.folder / relative, copy):
            problems.append(f"{name}: differs from the source's")
    return problems


def _metadata_problems(produced: dict[str, TensorInfo]) -> list[str]:
    """Each weight file's ``__metadata__`` is what the conversion writes ({"format": "pt"}): transformers 4.x refuses
    another format, or loads it through TensorFlow or Flax."""
    from .safetensors_io.write import SHARD_METADATA
    from .safetensors_io.read import read_header

    problems = []
    for file in sorted({info.path for info in produced.values()}):
        metadata = read_header(file)[1]
        if metadata != SHARD_METADATA:
            problems.append(f"{file.name}: __metadata__ is {json.dumps(metadata)}, a conversion writes {json.dumps(SHARD_METADATA)}")
    return problems


def _same_bytes(original: Path, copy: Path) -> bool:
    """Whether two files hold the same bytes, read a piece at a time (filecmp trusts the sizes and times it caches)."""
    piece = 1 << 20
    try:
        if original.stat().st_size != copy.stat().st_size:
            return False
        with open(original, "rb") as first, open(copy, "rb") as second:
            while (data := first.read(piece)) == second.read(piece):
                if not data:
                    return True
            return False
    except OSError as error:  # a read error names no file: both are named
        raise CheckpointError(f"{error.filename or f'{original} or {copy}'}: cannot be read ({error.strerror or error})") from None


def _layout_problems(tensors, context: "_Context") -> list[str]:
    """Each tensor in the shape transformers' own model loads there (a quant state's recorded shape can contradict
    the model: the output would then not load), and each quantized weight in the orientation of the layer there: a
    Conv1D's (in, out), transposed from how it was quantized, any other's as quantized. The plan decides both from
    the checkpoint and formats/conv1d.py; this asks transformers."""
    problems = []
    for tensor in tensors:
        layer = context.module_class(tensor.name.rpartition(".")[0])
        if isinstance(innermost(tensor.recipe), QUANTIZED) and layer is not None:
            recipe, transposed = tensor.recipe, False
            while isinstance(recipe, (Transpose, MergeLora)):
                transposed |= isinstance(recipe, Transpose)
                recipe = recipe.base
            if (layer.__name__ == "Conv1D") != transposed:
                held = "(in, out), transposed" if transposed else "(out, in), as quantized"
                problems.append(f"{tensor.name}: transformers' model has a {layer.__name__} there; the output holds it {held}")
                continue
        loaded = context.parameter_shape(tensor.name)
        if loaded is not None and tuple(tensor.shape) != loaded:
            problems.append(f"{tensor.name}: {list(tensor.shape)} from the source, transformers' model loads {list(loaded)} there")
    return problems


def _output_dtype(output: Path, produced: dict[str, TensorInfo]) -> str:
    """The output's dtype: that of most of its floating tensors (those of another are named one by one)."""
    codes = {dtype.code for dtype in OUTPUT_DTYPES.values()}
    counts = Counter(info.dtype for info in produced.values() if info.dtype in codes)
    if not counts:
        raise CheckpointError(f"{output}: no fp16, bf16 or fp32 tensors, so not a converted checkpoint")
    return DTYPES[counts.most_common(1)[0][0]].name


def _plan_source(folder: Path, output: Path, dtype: str, reader: TensorReader, adapter: Path | None):
    try:
        return make_plan(folder, dtype=dtype, reader=reader, adapter=adapter)
    except CheckpointError:
        # OUT and SOURCE swapped: the "output" is the bitsandbytes checkpoint.
        try:
            swapped = any(bnb4.STATE_KEY.match(name) or name.endswith(f".{bnb8.PARTS[0]}") for name in read_tensors(output))
        except CheckpointError:
            swapped = False
        if swapped:
            raise ArgumentError(f"{output} is a bitsandbytes checkpoint and {folder} is not: the order is OUT, then SOURCE") from None
        raise


def verify(output: str | Path, source: str, *, device: str = "auto", adapter: str | None = None,
           revision: str | None = None, token: str | None = None, cache_dir: str | None = None,
           progress: bool = False) -> VerifyReport:  # fmt: skip
    """Compare the converted checkpoint in ``output`` with ``source`` (and the LoRA ``adapter`` merged into it, by
    peft's own merge); mismatches go in the report, not exceptions.

    Raises:
        ArgumentError: a bad ``device``, an empty ``output``, ``source`` or ``adapter``, or ``output`` and ``source``
            given the wrong way round.
        SourceNotFoundError: ``output`` is not a folder, or ``source`` cannot be found or fetched.
        CheckpointError: a file of ``output`` or ``source`` is corrupt, or ``source`` is not convertible.
        DependencyError: bitsandbytes (or, with an adapter, peft) cannot be imported.

    Example:
        >>> report = verify("llama-1b-bf16", "unsloth/Llama-3.2-1B-Instruct-bnb-4bit")
        >>> report.ok
    """
    from tqdm.auto import tqdm

    from .conversion import named_sources, resolve_source
    from .devices import pick_device

    source, adapter = named_sources(source, adapter)
    output = os.fspath(output)
    if not output.strip():
        raise ArgumentError("output is empty; give the converted checkpoint's folder", option="output")
    output = expanded(output, "output")
    if not output.is_dir():
        raise SourceNotFoundError(f"{output}: {'a file, not a folder' if output.exists() else 'no such folder'}")
    chosen = pick_device(device, kernel=False)  # bitsandbytes recomputes: no Triton needed
    with _quiet_loggers():
        _reference_library("bitsandbytes")
        folder, adapter_folder, _, _ = resolve_source(source, adapter, revision=revision, token=token, cache_dir=cache_dir,
                                                      progress=progress)  # fmt: skip
        if adapter_folder is not None:
            _reference_library("peft")
        if folder.resolve() == output.resolve():
            raise ArgumentError(f"{output} is given as both OUT and SOURCE: the order is the converted checkpoint, then "
                                "the bitsandbytes one")  # fmt: skip
        return _verify(output, folder, adapter_folder, chosen, progress, tqdm)


@contextlib.contextmanager
def _quiet_loggers():
    """bitsandbytes warns on import about an optional CPU matmul kernel that verification never uses, and peft about
    the stand-in models it is handed (in its log and as Python warnings: a config key it does not know, a layer class
    it adjusts fan_in_fan_out for): quiet while verifying, as the caller had them after."""
    import logging
    import warnings

    loggers = [logging.getLogger(name) for name in ("bitsandbytes.backends.cpu.ops", "peft")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"peft(\.|$)")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _reference_library(name: str) -> None:
    """DependencyError unless ``name`` imports: without its reference library verify can recompute nothing, which is
    not a difference in the weights."""
    import importlib

    try:
        importlib.import_module(name)
    except Exception as error:  # noqa: BLE001  (ImportError, or a broken install failing inside its import)
        what = "LoRA merges (peft's own merge)" if name == "peft" else "the weights (bitsandbytes' dequantization)"
        raise DependencyError(f"verify recomputes {what} with {name}, which cannot be imported ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''}); install it: pip install {name}") from None


def _verify(output: Path, folder: Path, adapter_folder, chosen, progress: bool, tqdm) -> VerifyReport:
    report = VerifyReport(output, device=str(chosen))
    with TensorReader() as source_reader, TensorReader() as output_reader:
        produced = read_tensors(output)
        plan = _plan_source(folder, output, _output_dtype(output, produced), source_reader, adapter_folder)
        report.problems += _weight_file_problems(output, produced)
        report.problems += _leftovers(produced, output, plan.config)
        report.problems += _carried_problems(plan, output)
        report.problems += _unexpected_files(plan, output, produced)
        report.problems += _metadata_problems(produced)
        expected = {tensor.name: tensor for tensor in plan.tensors}
        report.problems += [f"{name}: in the source, missing from the output" for name in sorted(set(expected) - set(produced))]
        report.problems += [f"{name}: in the output, not in the source" for name in sorted(set(produced) - set(expected))]
        names = sorted(set(expected) & set(produced))
        context = _Context(expected, *meta_model(plan.config))
        report.problems += _layout_problems(plan.tensors, context)
        for name in tqdm(names, desc=f"verifying {output.name}", unit="tensor", disable=not progress, dynamic_ncols=True):
            report.checked += 1
            problem = _compare(expected[name], produced[name], source_reader, output_reader, chosen, report, context)
            if problem:
                report.problems.append(f"{name}: {problem}")
    if context.unbuilt() is not None:
        report.notes.append(f"config.json: transformers could not build the model from it ({context.unbuilt()}), so the "
                            "shapes it loads and its Conv1D layers were not checked")  # fmt: skip
    return report


def _compare(tensor: PlannedTensor, info: TensorInfo, source_reader, output_reader, device, report, context) -> str | None:
    if info.dtype != tensor.dtype or tuple(info.shape) != tuple(tensor.shape):
        return f"{info.dtype} {list(info.shape)} in the output, {tensor.dtype} {list(tensor.shape)} expected"
    reference, blame = REFERENCES[type(tensor.recipe)]
    if not isinstance(tensor.recipe, Copy):
        report.dequantized += 1
        report.merged += isinstance(tensor.recipe, MergeLora)
    try:
        expected = reference(tensor, source_reader, device, context).to("cpu")
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001  (the reference library refused this input: a finding, not a crash)
        return f"{blame} could not recompute it ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    got = output_reader.tensor(info)
    differ = _bits(got) != _bits(expected)
    mismatches = int(differ.sum())
    return f"{mismatches} of {got.numel()} elements differ from {blame}" if mismatches else None


def report_lines(report: VerifyReport) -> list[str]:
    libraries = "bitsandbytes and peft" if report.merged else "bitsandbytes"
    lines = [f"{report.output}: {report.checked} tensors checked ({report.dequantized} recomputed by {libraries} on {report.device})"]
    lines += [f"  MISMATCH {problem}" for problem in report.problems[:20]]
    if len(report.problems) > 20:
        lines.append(f"  ... and {len(report.problems) - 20} more problems")
    lines += [f"  note: {note}" for note in report.notes]
    count = len(report.problems)
    lines.append(f"OK: bit-exact with {libraries}" if report.ok else f"FAILED: {count} problem{'s' if count != 1 else ''}")
    return lines
