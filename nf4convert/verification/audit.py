"""Verify's checks of the output folder as a whole, beside the tensor comparison: the weight files laid out as
transformers finds them, no quantization key or config left, every carried file there with the source's bytes,
nothing a conversion does not write, each tensor in the shape and orientation transformers' own model loads."""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path

from ..errors import CheckpointError
from ..files import FOREIGN_FILES, IGNORED_FILES, INDEX_NAME, SKIPPED_DIRS, WRITTEN_ANEW
from ..formats.base import quantization_key
from ..safetensors_io.read import TensorInfo, read_header, read_index
from ..safetensors_io.write import SHARD_METADATA
from ..strict_json import strict_json


def _json_text(value) -> str:
    """JSON as compared: by its text, so that 4 and 4.0, or false and 0 (equal in Python), differ as loaders do."""
    return json.dumps(value, sort_keys=True)


def leftovers(produced: dict[str, TensorInfo], output: Path, expected_config: dict | None) -> list[str]:
    """Quantization keys left in the output, and a config.json that is not the source's made dense (no
    quantization_config, the output's dtype recorded): what transformers would load the weights with. A source
    without a config.json gets none in its output."""
    problems = [
        f"{name}: a quantization key remains in the output" for name in sorted(produced) if quantization_key(name)
    ]
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
        keys = sorted(
            k
            for k in set(config) | set(expected_config)
            if k not in config or k not in expected_config or _json_text(config[k]) != _json_text(expected_config[k])
        )
        problems.append(f"config.json: differs from the source's made dense (in {', '.join(keys[:5])})")
    return problems


def weight_file_problems(output: Path, produced: dict[str, TensorInfo]) -> list[str]:
    """The output's weight files as transformers finds them: one ``model.safetensors`` without an index, or shards
    named by ``model.safetensors.index.json``, whose ``metadata.total_size`` is their tensors' bytes, and no other
    ``.safetensors`` file (beside an index, a ``model.safetensors`` is what transformers loads). That the index maps
    exactly the output's tensors, each to the file holding it, read_tensors checked already (it refuses otherwise)."""
    files = sorted(
        path.name
        for path in output.glob("*.safetensors")
        if not any(fnmatch.fnmatch(path.name, pattern) for pattern in FOREIGN_FILES)
    )  # an adapter's: unexpected_files
    index = output / INDEX_NAME
    if not index.is_file():
        others = sorted(path.name for path in output.glob("*.safetensors.index.json"))
        if others:
            return [
                f"{INDEX_NAME}: missing (the output's index is named {others[0]}, which transformers does not look for)"
            ]
        if len(files) > 1:
            return [f"{INDEX_NAME}: missing; transformers loads none of the output's {len(files)} shards without it"]
        if files and files != ["model.safetensors"]:
            return [
                f"{files[0]}: a single-file output must be named model.safetensors "
                "(the only name transformers looks for)"
            ]
        return []
    listed = set(read_index(output).values())
    problems = []
    if "model.safetensors" in files and listed != {"model.safetensors"}:
        problems.append("model.safetensors: beside the index; transformers loads it and ignores the shards")
    problems += [
        f"{name}: a .safetensors file the index does not name"
        for name in files
        if name not in listed | {"model.safetensors"}
    ]
    raw = strict_json(index.read_bytes(), INDEX_NAME)  # read_index has read it: JSON, an object
    metadata = raw.get("metadata")
    total = sum(info.nbytes for info in produced.values())
    if not isinstance(metadata, dict):
        problems.append(f"{INDEX_NAME}: no 'metadata' object (transformers' loader reads it)")
    elif (
        type(metadata.get("total_size")) is not int or metadata["total_size"] != total
    ):  # 7.0e6 is not an int to loaders
        problems.append(
            f"{INDEX_NAME}: metadata.total_size is {metadata.get('total_size')!r}, "
            f"the shards hold {total} bytes of tensors"
        )
    return problems


def unexpected_files(plan, output: Path, produced: dict[str, TensorInfo]) -> list[str]:
    """Every file in OUT is one a conversion of this source writes, and a file, not a link: the weights, their index,
    config.json (when the source has one), the model card and the carried files. Anything else would be loaded
    beside the converted weights (a generation_config.json, a chat template, remote code, an adapter, other weights)
    or, a link, would change with what it points to. Weight files and indexes at the root are weight_file_problems'."""
    written = {info.path.name for info in produced.values()} | {INDEX_NAME, *WRITTEN_ANEW}
    written |= {relative.as_posix() for relative in (*plan.side_files, *plan.added_files)}
    theirs = ("*.safetensors",) if (output / INDEX_NAME).is_file() else ("*.safetensors", "*.safetensors.index.json")
    problems = []
    for folder, dirs, files in os.walk(output):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        for name in sorted(files) + [d for d in dirs if (Path(folder) / d).is_symlink()]:
            path = Path(folder) / name
            relative = path.relative_to(output).as_posix()
            if path.is_symlink():
                problems.append(
                    f"{relative}: a link (to {os.readlink(path)}); a conversion writes files, and the output "
                    "would change with what the link points to"
                )
            elif relative in written or name in IGNORED_FILES:
                continue
            elif any(fnmatch.fnmatch(name, pattern) for pattern in FOREIGN_FILES):
                problems.append(
                    f"{relative}: in the output, but no conversion writes it (a loader would read it instead "
                    "of, or beside, the converted weights)"
                )
            elif "/" not in relative and any(fnmatch.fnmatch(name, pattern) for pattern in theirs):
                continue
            else:
                problems.append(
                    f"{relative}: in the output, but not in the source, and a conversion writes no such file"
                )
    return sorted(problems)  # by path


def carried_problems(plan, output: Path) -> list[str]:
    """Every file the conversion carries over unchanged (plan.side_files) in the output, byte for byte.
    config.json is compared made dense (leftovers); the model card is written anew."""
    problems = []
    for relative in plan.side_files:
        name = relative.as_posix()
        copy = output / relative
        if not copy.is_file():
            problems.append(f"{name}: carried over from the source, missing from the output")
        elif not _same_bytes(plan.folder / relative, copy):
            problems.append(f"{name}: differs from the source's")
    for relative, added in plan.added_files.items():  # a kind's (a resized vocabulary's tokenizer: the adapter's)
        copy = output / relative
        if not copy.is_file():
            problems.append(f"{relative.as_posix()}: {added.named}, missing from the output")
        elif not _same_bytes(added.path, copy):
            problems.append(f"{relative.as_posix()}: differs from {added.owner}")
    return problems


def metadata_problems(produced: dict[str, TensorInfo]) -> list[str]:
    """Each weight file's ``__metadata__`` is what the conversion writes ({"format": "pt"}): transformers 4.x refuses
    another format, or loads it through TensorFlow or Flax."""
    problems = []
    for file in sorted({info.path for info in produced.values()}):
        metadata = read_header(file)[1]
        if metadata != SHARD_METADATA:
            problems.append(
                f"{file.name}: __metadata__ is {json.dumps(metadata)}, a conversion writes {json.dumps(SHARD_METADATA)}"
            )
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
        raise CheckpointError(
            f"{error.filename or f'{original} or {copy}'}: cannot be read ({error.strerror or error})"
        ) from None


def layout_problems(tensors, context) -> list[str]:
    """Each tensor in the shape transformers' own model loads there (a quant state's recorded shape can contradict
    the model: the output would then not load), and each quantized weight in the orientation of the layer there: a
    Conv1D's (in, out), transposed from how it was quantized, any other's as quantized. The plan decides both from
    the checkpoint and model/conv1d.py; this asks transformers."""
    problems = []
    for tensor in tensors:
        layer = context.module_class(tensor.name.rpartition(".")[0])
        if tensor.recipe.quantized and layer is not None:
            transposed = tensor.recipe.transposed
            if (layer.__name__ == "Conv1D") != transposed:
                held = "(in, out), transposed" if transposed else "(out, in), as quantized"
                problems.append(
                    f"{tensor.name}: transformers' model has a {layer.__name__} there; the output holds it {held}"
                )
                continue
        loaded = context.parameter_shape(tensor.name)
        if loaded is not None and tuple(tensor.shape) != loaded:
            problems.append(
                f"{tensor.name}: {list(tensor.shape)} from the source, transformers' model loads {list(loaded)} there"
            )
    return problems
