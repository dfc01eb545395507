"""What a compressed-tensors ``quantization_config`` must be before any format reads its groups: every field a format
reads, of the type it reads (a config of another shape is refused in one line, never met by an AttributeError), and
the settings that say the checkpoint holds no compressed weights a dense model can be made from, whatever the
groups' formats: a status other than ``compressed``, sparse weights, online rotations. Every format reading such
configs asks it first (``compressed_nvfp4.check_groups`` in the planner, each format's ``config_problem``)."""

from __future__ import annotations

import re

from .packed_int import CONFIG

_AT = f"{CONFIG}: quantization_config"
# A group's fields and the types a format reads them as (None: absent, always allowed)
_GROUP_FIELDS = {"targets": list, "weights": dict, "input_activations": dict, "output_activations": dict, "format": str}
_WEIGHT_FIELDS = {
    "num_bits": int,
    "group_size": int,
    "strategy": str,
    "type": str,
    "symmetric": bool,
    "block_structure": list,
}
_CONFIG_FIELDS = {
    "config_groups": dict,
    "ignore": list,
    "format": str,
    "quantization_status": str,
    "sparsity_config": dict,
    "kv_cache_scheme": dict,
}


def _of_type(value, kind) -> bool:
    if kind is int:
        return type(value) is int  # noqa: E721  (a bool is no integer here)
    return isinstance(value, kind)


def _names(value, what: str) -> str | None:
    """Why a list of module names or ``re:`` regular expressions is not one, or None."""
    for name in value:
        if not isinstance(name, str):
            return f"{what} holds {name!r}, not a module name or 're:' pattern"
        if name.startswith("re:"):
            try:
                re.compile(name[3:])
            except re.error as error:
                return f"{what} holds {name!r}, not a valid regular expression ({error})"
    return None


def shape_problem(quantization: dict) -> str | None:
    """Why a compressed-tensors quantization_config is not of the shape compressed-tensors writes, or None."""
    for key, kind in _CONFIG_FIELDS.items():
        value = quantization.get(key)
        if value is not None and not _of_type(value, kind):
            return f"{_AT} {key} is {value!r}, not a {kind.__name__}"
    problem = _names(quantization.get("ignore") or [], f"{_AT} ignore")
    if problem:
        return problem
    for name, group in (quantization.get("config_groups") or {}).items():
        at = f"{_AT} config group {name!r}"
        if not isinstance(group, dict):
            return f"{at} is {group!r}, not a mapping"
        for key, kind in _GROUP_FIELDS.items():
            value = group.get(key)
            if value is not None and not _of_type(value, kind):
                return f"{at} {key} is {value!r}, not a {kind.__name__}"
        problem = _names(group.get("targets") or [], f"{at} targets")
        if problem:
            return problem
        for key, kind in _WEIGHT_FIELDS.items():
            value = (group.get("weights") or {}).get(key)
            if value is not None and not _of_type(value, kind):
                return f"{at} weights {key} is {value!r}, not a {kind.__name__}"
    return None


def settings_problem(quantization: dict) -> str | None:
    """Why a compressed-tensors config says its weights are no compressed ones a dense model is made of, or None."""
    status = quantization.get("quantization_status", "compressed")
    if status != "compressed":
        return f"{CONFIG}: quantization_status is {status!r}: its weights are not stored compressed"
    sparsity = quantization.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        return f"{CONFIG}: sparsity_config format {sparsity.get('format')!r} (sparse weights) is not read"
    if quantization.get("transform_config"):
        return f"{CONFIG}: transform_config (online rotations) has no place in a dense model"
    return None


def problem(quantization: dict) -> str | None:
    """The config's shape problem, else its settings problem, else None."""
    return shape_problem(quantization) or settings_problem(quantization)
