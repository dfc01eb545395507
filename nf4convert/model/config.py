"""A checkpoint's config.json: read strictly, what it says of quantization, tying and the vocabulary, and the dense
model's config written from it (no quantization_config anywhere, the output dtype recorded)."""

from __future__ import annotations

from pathlib import Path

from ..dtypes import DType
from ..errors import CheckpointError
from ..files import inside, read_regular
from ..strict_json import strict_json

# ModelOpt's quantization config beside config.json (its older exports write only this): read into the config as its
# ``quantization_config`` where config.json has none; the dense output has neither.
MODELOPT_CONFIG = "hf_quant_config.json"


def read_config(folder: Path) -> dict | None:
    """config.json, read strictly; where it has no quantization_config and ModelOpt's ``hf_quant_config.json`` lies
    beside it, that file's ``quantization`` as one (``quant_method: "modelopt"``, as ModelOpt's newer exports write
    it into config.json)."""
    config = _read_object(folder, "config.json")
    if config is None or quantization_config(config) is not None:
        return config
    side = _read_object(folder, MODELOPT_CONFIG)
    if side is None:
        return config
    details = side.get("quantization")
    if not isinstance(details, dict):
        raise CheckpointError(f"{folder / MODELOPT_CONFIG}: has no 'quantization' object")
    return {**config, "quantization_config": {**details, "quant_method": "modelopt"}}


def _read_object(folder: Path, name: str) -> dict | None:
    path = folder / name
    if not path.exists() and not path.is_symlink():  # a dangling link is a config that cannot be read, not none
        return None
    inside(folder, name)
    try:
        raw = read_regular(path)
    except FileNotFoundError as error:  # a dangling link
        raise CheckpointError(f"{path}: cannot be read ({error.strerror})") from None
    config = strict_json(raw, str(path))
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return config


def check_present(config: dict | None, source: str, *, allow_missing: bool) -> None:
    """CheckpointError for a checkpoint without config.json (``config`` None), unless ``allow_missing``: its output
    would have none either, and transformers loads no model without one (it reads the model's type there)."""
    if config is None and not allow_missing:
        raise CheckpointError(
            f"{source}: has no config.json, so its output would not load in transformers as a model (it reads the "
            "model's type there); add the model's config.json to it",
            option="allow_no_config",
        )


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


def quantization_config(config) -> dict | None:
    """config.json's quantization_config (a nested model config's, for a multimodal model), if any."""
    if not isinstance(config, dict):
        return None
    if isinstance(config.get("quantization_config"), dict):
        return config["quantization_config"]
    nested = (quantization_config(value) for value in config.values() if isinstance(value, dict))
    return next((found for found in nested if found is not None), None)


def tied(config: dict) -> bool:
    """Whether the model (or its text model) ties lm_head to the input embeddings; transformers' default is True."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))


def vocab_size(config: dict):
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return config.get("vocab_size", text.get("vocab_size"))


def quantization_configs(config) -> list[dict]:
    """Every ``quantization_config`` in a config.json, a nested model config's (a multimodal model's) included."""
    found = []

    def visit(node):
        if isinstance(node, dict):
            if isinstance(node.get("quantization_config"), dict):
                found.append(node["quantization_config"])
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(config)
    return found


def input_embedding(shapes: dict, config: dict) -> str | None:
    """The tensor a tied base ties its head to: the one 2-D tensor named like input embeddings (with the config's
    vocab_size rows, where it says), or None."""
    vocab = vocab_size(config)
    names = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight")
    found = [
        name
        for name, shape in shapes.items()
        if len(shape) == 2 and (not vocab or shape[0] == vocab) and name.endswith(names)
    ]
    return found[0] if len(found) == 1 else None


def untied_config(config: dict) -> dict:
    """config.json with the head untied: tie_word_embeddings false at the top and in a nested text config."""
    result = dict(config, tie_word_embeddings=False)
    if isinstance(result.get("text_config"), dict):
        result["text_config"] = dict(result["text_config"], tie_word_embeddings=False)
    return result


def resized_config(config: dict, rows: int) -> dict:
    """config.json with the adapter's vocabulary size, at the top and in a nested text config (where it is kept)."""
    result = dict(config, vocab_size=rows) if "vocab_size" in config or "text_config" not in config else dict(config)
    if isinstance(result.get("text_config"), dict):
        result["text_config"] = dict(result["text_config"], vocab_size=rows)
    return result
