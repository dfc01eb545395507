"""Whether a conversion's output fits the model its config.json describes: every tensor in the shape transformers' own
model loads there and every parameter of that model given, by transformers' loading rules (``skeleton.loaded``), or,
where transformers builds no model from the config, by the config's own dimensions. A checkpoint at odds with its
config (a group index one entry short, two projections swapped, a layer or an expert left out) is refused in one line
naming the tensor, before anything is written."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import CheckpointError
from .skeleton import Unbuilt, loaded, meta_model

# name ending -> (rows, columns) as config.json's dimensions (``_dimensions``) make them, in the common decoder layout
_BY_CONFIG = {
    "self_attn.q_proj.weight": ("attention", "hidden"),
    "self_attn.k_proj.weight": ("kv", "hidden"),
    "self_attn.v_proj.weight": ("kv", "hidden"),
    "self_attn.o_proj.weight": ("hidden", "attention"),
    "mlp.gate_proj.weight": ("intermediate", "hidden"),
    "mlp.up_proj.weight": ("intermediate", "hidden"),
    "mlp.down_proj.weight": ("hidden", "intermediate"),
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def _shown(shape) -> str:
    return str(list(shape))


def _one_line(folder: Path, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(
            f"{folder}: {problems[0]}{more}; the checkpoint does not fit the model of its config.json"
        )


def _dimensions(config: dict) -> dict[str, int]:
    """The dimensions config.json gives (or the text config of a multimodal one), where they are whole numbers."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}

    def number(key):
        value = config.get(key, text.get(key))
        return value if type(value) is int and value > 0 else None

    hidden, heads = number("hidden_size"), number("num_attention_heads")
    head_dim = number("head_dim") or (hidden // heads if hidden and heads and hidden % heads == 0 else None)
    kv = number("num_key_value_heads") or heads
    found = {
        "hidden": hidden,
        "intermediate": number("intermediate_size"),
        "attention": heads * head_dim if heads and head_dim else None,
        "kv": kv * head_dim if kv and head_dim else None,
    }
    return {key: value for key, value in found.items() if value is not None}


def _by_config(config: dict, shapes: dict[str, tuple]) -> list[str]:
    """Where transformers builds no model: each decoder layer's projections in the shape the config's dimensions give
    (layers past ``num_hidden_layers`` too: a multi-token-prediction layer is one)."""
    dims = _dimensions(config)
    problems = []
    for name, shape in shapes.items():
        layer = _LAYER.search(name)
        if layer is None:
            continue
        wanted = _BY_CONFIG.get(layer.group(2))
        if wanted and all(part in dims for part in wanted):
            want = tuple(dims[part] for part in wanted)
            if tuple(shape) != want:
                problems.append(
                    f"{name}: {_shown(shape)} from the checkpoint, config.json's dimensions make {_shown(want)}"
                )
    return problems


def _by_parameters(config: dict, shapes: dict[str, tuple]) -> list[str]:
    """Where transformers has no loading rules to ask: each tensor in the shape of the model's parameter of its name."""
    parameter_shape = meta_model(config)[1]
    problems = []
    for name, shape in shapes.items():
        own = parameter_shape(name)
        if own is not None and tuple(shape) != own:
            problems.append(
                f"{name}: {_shown(shape)} from the checkpoint, transformers' model loads {_shown(own)} there"
            )
    return problems


def check_fits(folder: Path, config: dict | None, shapes: dict[str, tuple], source: frozenset = frozenset()) -> None:
    """CheckpointError naming the first tensor (``shapes``: the output's, name -> shape) that transformers' model for
    ``config`` (the output's config.json) loads in another shape, cannot make from them, or has and is not given (it
    would fill it with random values; ``source``: the checkpoint's tensor names, to say which side lacks it). Nothing
    is checked without a config."""
    if config is None:
        return
    found = loaded(config, shapes)
    if isinstance(found, Unbuilt):
        _one_line(folder, _by_config(config, shapes))
        return
    if isinstance(found, str):
        _one_line(folder, _by_parameters(config, shapes))
        return
    model, missing, mismatched, failed = found
    problems = [
        f"{name}: {_shown(given)} from the checkpoint, transformers' {model} loads {_shown(own)} there"
        for name, given, own in mismatched
    ]
    problems += [
        f"{name}: transformers' {model} cannot make it from the checkpoint's tensors ({why})" for name, why in failed
    ]
    lacks = {True: "the checkpoint holds it but the output would lack it", False: "the checkpoint lacks it"}
    problems += [
        f"{name}: transformers' {model} has this parameter and {lacks[name in source]} (it would be loaded with "
        "random values)"
        for name in missing
    ]
    _one_line(folder, problems)
