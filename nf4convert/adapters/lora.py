"""peft LoRA adapters: what an adapter folder changes in its base model, read from its config
(``peft_config.py``) and its tensors: a target per changed base tensor, with the LoRA factors, saved weights or
trainable-token rows that change it. Checked against the base in ``peft_checks.py``; merged in ``peft_merge.py``;
tied bases in ``peft_tied.py``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..dtypes import DTYPES
from ..errors import CheckpointError
from ..files import ADAPTER_WEIGHTS, inside
from ..safetensors_io.read import TensorInfo, read_header
from .config import (
    CONFIG_NAME,
    indices_for,
    is_embedding,
    number,
    parameter_targets,
    pattern_value,
    read_config,
    saved_whole,
    targeted,
)

WEIGHTS_NAME = ADAPTER_WEIGHTS
PEFT_PREFIX = "base_model.model."


def per_token(module: str) -> bool:
    """Whether ``module`` has a row per token (input embeddings or output head), which resizing the vocabulary grows."""
    return is_embedding(module) or module.rpartition(".")[2] == HEAD.partition(".")[0]


# Suffixes of saved LoRA parameters (peft removes the adapter name when saving): suffix -> role.
LINEAR_ROLES = {".lora_A.weight": "lora_A", ".lora_B.weight": "lora_B", ".lora_B.bias": "lora_B.bias"}
EMBEDDING_ROLES = {".lora_embedding_A": "lora_embedding_A", ".lora_embedding_B": "lora_embedding_B"}
MAGNITUDE_SUFFIX = ".lora_magnitude_vector"
# Trainable tokens: the saved rows, and the wrapped layer's own weight (saved with save_embedding_layers).
TOKENS_SUFFIX = ".token_adapter.trainable_tokens_delta"
TOKENS_BASE = ".token_adapter.base_layer."
# The output head transformers ties to the input embeddings (get_output_embeddings) in the models this tool unties.
HEAD = "lm_head.weight"


@dataclass(frozen=True)
class LoraTarget:
    """One base tensor the adapter changes and how.

    kind: "linear" (LoRA/DoRA on a Linear or Conv1D weight), "embedding" (on an Embedding weight), "param" (LoRA on
    a parameter named by target_parameters: peft's ``ParamWrapper``, on a 3-D fused-experts parameter), "bias"
    (``lora_bias``: ``lora_B.bias * scaling`` added to the module's bias), "replace" (the saved tensor replaces
    the base's: ``modules_to_save``, saved biases, saved embedding weights), "tokens" (trainable tokens: the saved
    rows replace rows ``indices`` of an embedding or head).
    tensors: role -> the adapter's TensorInfo. Roles: lora_A, lora_B, lora_magnitude_vector (DoRA),
    lora_embedding_A, lora_embedding_B, lora_B.bias, trainable_tokens_delta, and "base" for a saved tensor that
    replaces the base weight before any delta is merged (a "replace" target has only "base").
    saved_whole: a "replace" target that is a ``modules_to_save`` copy (the module's own copy, never the tied
    parameter), not a weight saved in place (``save_embedding_layers``, ``bias``).
    """

    name: str  # the base checkpoint's tensor, e.g. model.layers.0.self_attn.q_proj.weight
    kind: str
    module: str  # the module path peft matched rank_pattern/alpha_pattern against
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    rank: int | None = None
    alpha: float | None = None
    scaling: float | None = None
    fan_in_fan_out: bool = False
    use_dora: bool = False
    use_rslora: bool = False
    indices: tuple[int, ...] | None = None  # "tokens": the rows replaced, in peft's order
    saved_whole: bool = False
    depth: int = 0  # "param": how many wrappers of the module's other targeted parameters it lies inside
    experts: int = 0  # "param": the parameter's leading dimension, each expert's LoRA a slice of the factors
    transposed: bool = False  # "param": the parameter is [experts, in, out] (the module's is_transposed)


@dataclass
class Adapter:
    folder: Path
    path: Path  # adapter_model.safetensors
    config: dict
    base_model_name_or_path: str | None
    targets: dict[str, LoraTarget]  # base tensor name -> target
    tensors: dict[str, TensorInfo]  # every tensor of the adapter file


def load_adapter(folder: Path) -> Adapter:
    """Read ``adapter_config.json`` and the header of ``adapter_model.safetensors`` (no tensor data) of a peft
    LoRA adapter, and map every base tensor it changes to a :class:`LoraTarget`.

    >>> adapter = load_adapter(Path("my-qlora-adapter"))
    >>> adapter.targets["model.layers.0.self_attn.q_proj.weight"].scaling
    2.0
    """
    folder = Path(folder)
    config_path, config = read_config(folder)
    path = inside(folder, WEIGHTS_NAME, what="adapter")
    if not path.is_file():
        pickled = (folder / "adapter_model.bin").exists()
        why = " (only adapter_model.bin: pickled adapters are not read)" if pickled else ""
        raise CheckpointError(f"{path}: missing{why}")
    tensors, _ = read_header(path)

    # Group the saved keys by module: module path -> role -> TensorInfo; other keys replace base tensors.
    lora_modules: dict[str, dict[str, TensorInfo]] = {}
    token_modules: dict[str, TensorInfo] = {}  # module path -> its trainable tokens' saved rows
    replacements: dict[str, tuple[TensorInfo, bool]] = {}  # base tensor name -> (saved tensor, via base_layer)
    suffixes = (*LINEAR_ROLES.items(), *EMBEDDING_ROLES.items(), (MAGNITUDE_SUFFIX, "lora_magnitude_vector"))
    for key, info in tensors.items():
        if not key.startswith(PEFT_PREFIX):
            raise CheckpointError(f"{path}: tensor '{key}' does not start with '{PEFT_PREFIX}' (not saved by peft)")
        if not DTYPES[info.dtype].cast:
            raise CheckpointError(f"{path}: tensor '{key}' has dtype {info.dtype}, not a floating type")
        rest = key[len(PEFT_PREFIX) :]
        if rest.endswith(TOKENS_SUFFIX):
            token_modules[rest[: -len(TOKENS_SUFFIX)]] = info
            continue
        if TOKENS_BASE in rest:  # the token adapter's wrapped layer: that module's own weight
            replacements[rest.replace(TOKENS_BASE, ".")] = (info, True)
            continue
        for suffix, role in suffixes:
            if rest.endswith(suffix):
                lora_modules.setdefault(rest[: -len(suffix)], {})[role] = info
                break
        else:
            if re.search(r"(^|\.)lora_\w+(\.|$)", rest):
                raise CheckpointError(f"{path}: tensor '{key}' is no LoRA parameter that peft saves")
            # peft's load_state_dict puts these into the base parameters: "x.base_layer.weight" is x's own weight.
            replacements[rest.replace(".base_layer.", ".")] = (info, ".base_layer." in rest)

    parameters: dict[str, LoraTarget] = {}  # LoRA on target_parameters, by the module path its tensors carry
    for module, roles in list(lora_modules.items()):
        target = _parameter_target(path, config, module, roles)
        if target is not None:
            parameters[module] = target
            del lora_modules[module]
    for module, roles in lora_modules.items():
        if not targeted(config, module):  # peft would create no LoRA layer there and leave these tensors unused
            raise CheckpointError(
                f"{path}: tensor '{next(iter(roles.values())).name}' is for '{module}', which "
                f"target_modules {config['target_modules']!r} does not name"
            )
        if (entry := saved_whole(config, module)) is not None:
            where = "is in" if module == entry or module.endswith("." + entry) else f"lies in '{entry}' of"
            raise CheckpointError(
                f"{path}: '{module}' has LoRA tensors and {where} modules_to_save too (peft gives it "
                "no LoRA layer and would leave them unused)"
            )
    targets: dict[str, LoraTarget] = dict(parameters)  # keyed by module path until peft_params names them
    for module, roles in lora_modules.items():
        for target in _module_targets(path, config_path, config, module, roles):
            # the module's own base parameters, saved as "<module>.base_layer.<param>", are loaded before the merge
            if replacements.get(target.name, (None, False))[1]:
                target.tensors["base"] = replacements.pop(target.name)[0]
            targets[target.name] = target

    if token_modules and config.get("trainable_token_indices") is None:
        some = next(iter(token_modules.values()))
        raise CheckpointError(
            f"{path}: tensor '{some.name}' holds trainable tokens but {CONFIG_NAME} has no trainable_token_indices"
        )
    for module, info in token_modules.items():
        if module in lora_modules or saved_whole(config, module) is not None:
            raise CheckpointError(
                f"{path}: '{module}' has trainable tokens and LoRA tensors or modules_to_save too; peft refuses that"
            )
        target = LoraTarget(
            f"{module}.weight",
            "tokens",
            module=module,
            tensors={"trainable_tokens_delta": info},
            indices=indices_for(config, module, config_path),
        )
        if replacements.get(target.name, (None, False))[1]:
            target.tensors["base"] = replacements.pop(target.name)[0]
        targets[target.name] = target

    for name, (info, via_base_layer) in replacements.items():
        module = name.rpartition(".")[0]
        if (module in lora_modules or module in token_modules) != via_base_layer:
            # peft loads a LoRA module's own parameters from "<module>.base_layer.<param>" only, and has no
            # "base_layer" anywhere else: it would ignore this tensor
            raise CheckpointError(f"{path}: tensor '{info.name}' maps to no parameter of the model peft builds")
        targets[name] = LoraTarget(
            name, "replace", module=module, tensors={"base": info}, saved_whole=saved_whole(config, module) is not None
        )

    if config["ensure_weight_tying"] and any(t.kind in ("embedding", "replace", "tokens") for t in targets.values()):
        raise CheckpointError(
            f"{config_path}: ensure_weight_tying with adapted embeddings or modules_to_save: "
            "not mergeable tensor by tensor"
        )
    base = config.get("base_model_name_or_path")
    return Adapter(folder, path, config, base if isinstance(base, str) else None, targets, tensors)


BASE_LAYER = ".base_layer"


def _parameter_target(path: Path, config: dict, module: str, roles: dict) -> LoraTarget | None:
    """The LoRA of a parameter target_parameters names (None for a module's LoRA): peft wraps a module once per
    targeted parameter, each wrapper around the last, so the tensors of all but the outermost lie under
    ``.base_layer`` once per wrapper outside them. Which parameter each is, its rank and scaling are settled against
    the base model (``peft_params.resolve``)."""
    inner = module
    while inner.endswith(BASE_LAYER):
        inner = inner[: -len(BASE_LAYER)]
    if not parameter_targets(config, inner):
        return None
    if targeted(config, inner):
        raise CheckpointError(
            f"{path}: '{inner}' is named by both target_modules and target_parameters; peft refuses that"
        )
    if set(roles) != {"lora_A", "lora_B"}:
        odd = sorted(set(roles) - {"lora_A", "lora_B"}) or ["lora_A and lora_B"]
        raise CheckpointError(
            f"{path}: the LoRA of a parameter of '{inner}' has {', '.join(odd)}; peft's parameter wrapper has lora_A "
            "and lora_B only"
        )
    depth = (len(module) - len(inner)) // len(BASE_LAYER)
    return LoraTarget(module, "param", module=inner, tensors=dict(roles), depth=depth)


def _module_targets(path: Path, config_path: Path, config: dict, module: str, roles: dict) -> list[LoraTarget]:
    """The targets of one LoRA module (its weight, and its bias with lora_bias), checked against the config."""
    r = pattern_value(config["rank_pattern"], module, config["r"], config_path, "rank_pattern")
    r = number(r, config_path, f"r for '{module}'", integer=True)
    alpha = pattern_value(config["alpha_pattern"], module, config["lora_alpha"], config_path, "alpha_pattern")
    alpha = number(alpha, config_path, f"lora_alpha for '{module}'", integer=False)
    scaling = alpha / math.sqrt(r) if config["use_rslora"] else alpha / r  # LoraLayer.update_layer
    common = dict(module=module, rank=r, alpha=alpha, scaling=scaling)
    common.update(use_dora=config["use_dora"], use_rslora=config["use_rslora"])

    if roles.keys() & {"lora_A", "lora_B", "lora_B.bias"}:
        kind, a_role, b_role = "linear", "lora_A", "lora_B"
        if roles.keys() & {"lora_embedding_A", "lora_embedding_B"}:
            raise CheckpointError(f"{path}: module '{module}' has both linear and embedding LoRA weights")
    else:
        kind, a_role, b_role = "embedding", "lora_embedding_A", "lora_embedding_B"
    prefix = f"{PEFT_PREFIX}{module}"
    for role in (a_role, b_role):
        if role not in roles:
            expected = f"{prefix}.{role}{'.weight' if kind == 'linear' else ''}"
            raise CheckpointError(f"{path}: module '{module}' has no {role} (expected tensor '{expected}')")
    lora_a, lora_b = roles[a_role], roles[b_role]
    factors = f"'{lora_a.name}' {list(lora_a.shape)} and '{lora_b.name}' {list(lora_b.shape)}"
    if len(lora_a.shape) != 2 or len(lora_b.shape) != 2:
        raise CheckpointError(f"{path}: {factors}: only LoRA on 2-D weights (Linear, Conv1D, Embedding) can be merged")
    if lora_a.shape[0] != r or lora_b.shape[1] != r:
        raise CheckpointError(f"{path}: module '{module}' has rank {r} in {CONFIG_NAME} but {factors}")
    magnitude = roles.get("lora_magnitude_vector")
    if config["use_dora"] and magnitude is None:
        raise CheckpointError(f"{path}: use_dora is set but module '{module}' has no '{prefix}{MAGNITUDE_SUFFIX}'")
    if magnitude is not None and not config["use_dora"]:
        raise CheckpointError(
            f"{path}: tensor '{magnitude.name}' is a DoRA magnitude but {CONFIG_NAME} has no use_dora"
        )
    lora_bias = roles.get("lora_B.bias")
    if lora_bias is not None and not config["lora_bias"]:
        raise CheckpointError(f"{path}: tensor '{lora_bias.name}' is a LoRA bias but {CONFIG_NAME} has no lora_bias")

    weight_roles = {role: info for role, info in roles.items() if role != "lora_B.bias"}
    fan_in_fan_out = config["fan_in_fan_out"] and kind == "linear"  # validate() settles it from the shapes
    targets = [LoraTarget(f"{module}.weight", kind, tensors=weight_roles, fan_in_fan_out=fan_in_fan_out, **common)]
    if lora_bias is not None:
        targets.append(LoraTarget(f"{module}.bias", "bias", tensors={"lora_B.bias": lora_bias}, **common))
    return targets


def shape_of(value) -> tuple:
    """A base entry: a shape, a tuple whose first item is the shape, or anything with ``.shape``."""
    if hasattr(value, "shape"):
        return tuple(value.shape)
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], (tuple, list)):
        return tuple(value[0])
    return tuple(value)
