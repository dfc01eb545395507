"""A peft adapter's ``adapter_config.json``: read strictly, with peft's defaults, and refused in one line wherever peft
would not merge it the way this project reproduces (other peft types and LoRA variants, initialisations that rewrite
the base, restrictions to some layers, values peft itself refuses); and what it says of each module: targeted,
saved whole, its rank and alpha, its trainable tokens."""

from __future__ import annotations

import math
import re
from pathlib import Path

from ..errors import CheckpointError
from ..files import ADAPTER_WEIGHTS, inside, read_regular
from ..strict_json import strict_json

CONFIG_NAME = "adapter_config.json"


def is_adapter_folder(folder: Path) -> bool:
    """Whether a folder is a peft adapter alone (its config, and no model weights), which as SOURCE stands for the base
    its config names: a checkpoint that carries an adapter's config beside its weights is a checkpoint."""
    weights = [path for path in folder.glob("*.safetensors") if path.name != ADAPTER_WEIGHTS]
    return (folder / CONFIG_NAME).is_file() and not weights


# peft.LoraConfig's defaults for the fields the merge reads (importing peft takes seconds; tests check these).
CONFIG_DEFAULTS = {
    "r": 8,
    "lora_alpha": 8,
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "lora_bias": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "init_lora_weights": True,
    "ensure_weight_tying": False,
}


def _not_none(value) -> bool:
    return value is not None


def _truthy(value) -> bool:
    return bool(value)


def _sub_config(value) -> bool:  # LoraConfig.__post_init__ makes any dict, {} too, a (truthy) config object
    return isinstance(value, dict) or bool(value)


def _layer_indexes(value) -> bool:  # check_target_module_exists' is_using_layer_indexes: an int is a layer, 0 too
    return value is not None and value != []


# Config fields that, when set, make the merged model something other than base + LoRA/DoRA deltas: other LoRA
# variants, layers added or copied (layer_replication, trainable tokens), Megatron layers, and
# which modules get LoRA beyond target_modules (peft would leave some saved tensors unused). Each maps to "set" as
# peft 0.21 tests it: ``is not None`` where it does (for the sub-configs, _get_lora_subconfig refuses any other
# non-null value), else truthiness (``if config.layer_replication:``, resolve_lora_variant's ``bool(...)``).
# layers_pattern only qualifies layers_to_transform: read_config refuses it where peft does.
UNSUPPORTED_VARIANTS = {
    "velora_config": _not_none,
    "alora_invocation_tokens": _truthy,
    "monteclora_config": _sub_config,
    "use_bdlora": _not_none,
    "arrow_config": _not_none,
    "kasa_config": _not_none,
    "use_qalora": _truthy,
    "layer_replication": _truthy,
    "megatron_config": _truthy,
    "exclude_modules": _truthy,
    "layers_to_transform": _layer_indexes,
}


# init_lora_weights strings peft knows that only say how a new adapter starts (LoraLayer.update_layer; and
# "gaussian" in any case, reset_lora_parameters); _base_mutating() tells the others.
PLAIN_INITS = ("eva", "orthogonal")


def _base_mutating(init) -> bool:
    """init_lora_weights values after which the adapter only fits a base model that the init rewrote (PiSSA, OLoRA,
    CorDA, LoftQ and LoRA-GA subtract their initial delta from the base weights), or that select another variant
    (MiCA): tested as peft's ``LoraLayer.update_layer`` tests them (prefixes, and some without case)."""
    if not isinstance(init, str):
        return False
    return init.startswith(("pissa", "corda")) or init.lower() in ("olora", "mica") or init in ("loftq", "lora_ga")


def pattern_value(patterns: dict, module: str, default, config_path: Path, what: str):
    """peft's get_pattern_key: the first pattern (in file order) matching the module path's tail."""
    for key, value in patterns.items():
        try:
            matched = re.match(rf"(.*\.)?({key})$", module)
        except re.error as error:
            raise CheckpointError(
                f"{config_path}: {what} key {key!r} is not a valid regular expression ({error})"
            ) from None
        if matched:
            return value
    return default


def number(value, config_path: Path, what: str, *, integer: bool):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise CheckpointError(f"{config_path}: {what} is {value!r}, not a{'n integer' if integer else ' number'}")
    if value <= 0 and integer:
        raise CheckpointError(f"{config_path}: {what} is {value}, it must be positive")
    if not math.isfinite(value):
        raise CheckpointError(f"{config_path}: {what} is {value}, not a finite number")
    return value


def read_config(folder: Path) -> tuple[Path, dict]:
    # the checkpoint's rule for links: a Hub cache snapshot may read its repo's blobs, nothing may read outside
    config_path = inside(folder, CONFIG_NAME, what="adapter")
    try:
        raw = read_regular(config_path)
    except FileNotFoundError:
        raise CheckpointError(f"{config_path}: missing (not a peft adapter folder)") from None
    config = strict_json(raw, str(config_path))
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: not a JSON object")
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise CheckpointError(f"{config_path}: peft_type is {peft_type!r}; only LORA adapters can be merged")
    for name, default in CONFIG_DEFAULTS.items():
        if config.get(name) is None:
            config[name] = default
    for name, is_set in UNSUPPORTED_VARIANTS.items():
        if is_set(config.get(name)):
            raise CheckpointError(
                f"{config_path}: {name} is set ({config[name]!r}); only plain LoRA and DoRA adapters can be merged"
            )
    init = config["init_lora_weights"]
    if _base_mutating(init):
        raise CheckpointError(
            f"{config_path}: init_lora_weights is {init!r}: the adapter fits a base model rewritten by that init, "
            "not the original one (convert it with peft's path_initial_model_for_weight_conversion first)"
        )
    # Values peft refuses when it loads the adapter (LoraConfig.__post_init__, LoraLayer.update_layer,
    # BaseTuner._mark_only_adapters_as_trainable, check_target_module_exists)
    # peft initialises nothing for any false value (0, "", ...: update_layer tests its truth) and loads the weights
    if init and not (init is True or (isinstance(init, str) and (init.lower() == "gaussian" or init in PLAIN_INITS))):
        raise CheckpointError(
            f"{config_path}: init_lora_weights is {init!r}, not true, false or an initialisation "
            "peft knows; peft refuses this config"
        )
    bias = config.get("bias", "none")
    if not (isinstance(bias, str) and (bias in ("none", "all") or bias.endswith("_only"))):
        raise CheckpointError(
            f"{config_path}: bias is {bias!r}, not 'none', 'all' or 'lora_only'; peft refuses this config"
        )
    saved = config.get("modules_to_save")
    if not (saved is None or (isinstance(saved, list) and all(isinstance(m, str) for m in saved))):
        raise CheckpointError(
            f"{config_path}: modules_to_save is {saved!r}, not a list of module names; peft refuses this config"
        )
    for entry in saved or ():  # peft matches each entry as a regular expression (saved_whole)
        try:
            re.compile(rf"(^|.*\.){entry}($|\..*)")
        except re.error as error:
            raise CheckpointError(
                f"{config_path}: modules_to_save entry {entry!r} is not a valid pattern ({error}); "
                "peft matches each entry as one"
            ) from None
    _token_indices(config, config_path)
    pattern = config.get("layers_pattern")
    if pattern and config.get("layers_to_transform") is None:
        raise CheckpointError(f"{config_path}: layers_pattern without layers_to_transform: peft refuses this config")
    for name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config[name], dict):
            raise CheckpointError(f"{config_path}: {name} is not an object")
    for name in ("fan_in_fan_out", "use_rslora", "use_dora", "lora_bias"):
        if not isinstance(config[name], bool):
            raise CheckpointError(f"{config_path}: {name} is {config[name]!r}, not true or false")
    if config["lora_bias"] and (config["use_dora"] or init not in (True, False)):  # as LoraConfig.__post_init__
        raise CheckpointError(
            f"{config_path}: lora_bias with {'use_dora' if config['use_dora'] else f'init_lora_weights {init!r}'}: "
            "peft refuses this config"
        )
    _parameters(config, config_path)
    targets = config.get("target_modules")
    if config["target_parameters"] and targets in (None, []):  # peft: parameters alone are a valid target
        config["target_modules"] = targets = []
        return config_path, config
    if not (
        isinstance(targets, str) or (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets))
    ):
        raise CheckpointError(
            f"{config_path}: target_modules is {targets!r}, not a module name list or pattern "
            "(peft's per-architecture defaults are not read here)"
        )
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as error:
            raise CheckpointError(
                f"{config_path}: target_modules {targets!r} is not a valid pattern ({error})"
            ) from None
        for name in ("layers_to_transform", "layers_pattern"):  # LoraConfig.__post_init__
            if config.get(name) is not None:
                raise CheckpointError(f"{config_path}: {name} with a target_modules pattern: peft refuses this config")
    return config_path, config


def _parameters(config: dict, config_path: Path) -> None:
    """target_parameters as peft takes it (a list of parameter names or name tails; peft's ``lora.ParamWrapper``),
    and the settings its wrapper refuses with them."""
    names = config.get("target_parameters")
    config["target_parameters"] = names = names if names is not None else []
    if not (isinstance(names, list) and all(isinstance(name, str) and name for name in names)):
        raise CheckpointError(f"{config_path}: target_parameters is {names!r}, not a list of parameter names")
    if not names:
        return
    for name, refused in (("lora_dropout", 0), ("fan_in_fan_out", False), ("lora_bias", False), ("use_dora", False)):
        if config.get(name, refused) not in (refused, None):
            raise CheckpointError(
                f"{config_path}: target_parameters with {name} {config[name]!r}: peft's parameter wrapper refuses it"
            )


def parameter_targets(config: dict, module: str) -> list[str]:
    """The names of ``module``'s parameters that target_parameters names, as peft matches a parameter's full name
    (``module.parameter``) against each entry: the entry itself, or a tail of it after a dot."""
    found = []
    for entry in config.get("target_parameters") or ():
        parameter = entry.rpartition(".")[2]
        full = f"{module}.{parameter}"
        if (full == entry or full.endswith("." + entry)) and parameter not in found:
            found.append(parameter)
    return found


def _index_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)


def _token_indices(config: dict, config_path: Path) -> None:
    """trainable_token_indices as peft takes it: a list of token ids (the input embeddings'), or module name -> list."""
    indices = config.get("trainable_token_indices")
    if indices is None or _index_list(indices):
        return
    if not (isinstance(indices, dict) and all(isinstance(k, str) and _index_list(v) for k, v in indices.items())):
        raise CheckpointError(
            f"{config_path}: trainable_token_indices is {indices!r}, not a list of token ids or an "
            "object of module name -> token ids"
        )


def indices_for(config: dict, module: str, config_path: Path) -> tuple[int, ...]:
    """The rows peft's token adapter on ``module`` replaces: a list is the input embeddings' (and, on a tied model,
    the head's tied adapter's); a dict entry names a module by the end of its path (``_set_trainable``'s endswith)."""
    indices = config["trainable_token_indices"]
    if isinstance(indices, dict):
        found = [value for key, value in indices.items() if module.endswith(key)]
        if not found:
            raise CheckpointError(
                f"{config_path}: the adapter holds trainable tokens for '{module}', which "
                f"trainable_token_indices {indices!r} does not name"
            )
        indices = found[0]
    if len(set(indices)) != len(indices):  # index_copy with a repeated row keeps an unspecified one of its values
        raise CheckpointError(f"{config_path}: trainable_token_indices for '{module}' repeats a token id ({indices!r})")
    return tuple(indices)


def all_linear(targets) -> bool:
    return (
        isinstance(targets, str) and targets.lower() == "all-linear"
    )  # peft's INCLUDE_LINEAR_LAYERS_SHORTHAND, any case


def targeted(config: dict, module: str) -> bool:
    """Whether peft gives ``module`` (a dotted path) LoRA layers under ``target_modules``
    (``tuners_utils.check_target_module_exists``): a string is a full-match pattern, except "all-linear"
    (every Linear/Conv1D layer but the output layer); a list names module path suffixes."""
    targets = config["target_modules"]
    if targets == []:
        return False
    if all_linear(targets):
        return module.rpartition(".")[2] != "lm_head" and not is_embedding(module)
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == key or module.endswith("." + key) for key in targets)


def saved_whole(config: dict, module: str) -> str | None:
    """The ``modules_to_save`` entry under which peft gives ``module`` (a dotted path) no LoRA layer, or None: as
    ``tuners_utils.check_target_module_exists``, an entry is a regular expression matched against whole components
    of the path, so it names the module itself or any module above it (read_config checked that each compiles)."""
    for entry in config.get("modules_to_save") or ():
        if re.match(rf"(^|.*\.){entry}($|\..*)", module):
            return entry
    return None


# Which base modules are embeddings. peft gives an nn.Embedding an Embedding LoRA layer (lora_embedding_A/B) and
# every other layer a Linear one (lora_A/B; lora/layer.py dispatch_default), and loads only the tensors of the
# kind it made: the others are unexpected keys, and the layer merges its zero-delta initialisation. In transformers,
# every module of these names that holds a weight is an nn.Embedding (or a subclass), and no Linear or Conv1D has one
# of them, so linear-style tensors on such a name are refused at once. Many embeddings have other names (openai-gpt's
# tokens_embed, CTRL's w, Gemma 3n's embed_tokens_per_layer, ...): embedding-style tensors on any other name are
# checked against the class transformers' own model has there (skeleton.meta_model, built only then), and refused
# where it cannot be built (a remote-code model: nothing tells). Linear-style tensors on an embedding of another name
# (which only a hand-edited adapter holds: peft saves lora_embedding_* for embeddings) are not looked up, to spare
# every adapter transformers' import; verify builds its stand-in layers from transformers' class, so it reports them.
EMBEDDING_MODULES = (
    "embed_tokens",
    "wte",
    "wpe",
    "word_embeddings",
    "word_embedding",
    "token_embedding",
    "tok_embeddings",
    "embed_in",
    "shared",
    "embedding",
    "embeddings",
    "position_embeddings",
    "position_embedding",
    "embed_positions",
    "token_type_embeddings",
    "relative_attention_bias",
)


def is_embedding(module: str) -> bool:
    return module.rpartition(".")[2] in EMBEDDING_MODULES
