"""peft LoRA adapters: what an adapter folder changes in its base model, and the merge, bit for bit with peft.

The reference is ``PeftModel.from_pretrained(dense, ADAPTER).merge_and_unload()`` (peft 0.21), where ``dense`` is
the dense checkpoint loaded in the output dtype. What that does, step by step, and what this module reproduces:

- Loading. Each targeted module gets LoRA parameters created in the base dtype, then ``autocast_adapter_dtype``
  (on by default) upcasts every fp16/bf16 adapter parameter to **fp32**, then ``load_state_dict`` copies the saved
  tensors into them. So whatever dtype the file stores, the LoRA factors, DoRA magnitudes and ``lora_B.bias`` are
  fp32 on the base weight's device when merging, and peft's "upcast bf16/fp16 to fp32 on the CPU" branch of
  ``get_delta_weight`` never runs. Saved keys that are not LoRA parameters (a ``modules_to_save`` module's weights,
  biases saved with ``bias="all"|"lora_only"``, an embedding's ``base_layer.weight`` saved with
  ``save_embedding_layers``) are copied into the base parameters: the saved tensor cast to the output dtype.
- ``scaling = lora_alpha / r``, or ``lora_alpha / math.sqrt(r)`` with rsLoRA, Python floats; ``r`` and
  ``lora_alpha`` come from ``rank_pattern`` / ``alpha_pattern`` (the first key, in file order, that matches the
  module path as ``(.*\\.)?(key)$``), else from ``r`` / ``lora_alpha``.
- Linear (``Linear.get_delta_weight`` and ``merge``): ``delta = transpose(B @ A, fan_in_fan_out) * scaling`` in
  fp32, then ``weight += delta``: an in-place add of an fp32 tensor into the bf16/fp16 weight, computed in fp32
  and rounded once. peft forces ``fan_in_fan_out`` to match the layer (True for GPT-2's ``Conv1D``, False for
  ``nn.Linear``) whatever the config says; without the model we read it from the base weight's shape (see
  :func:`validate` for square weights).
- Embedding (``Embedding.get_delta_weight`` and ``merge``): ``delta = (B @ A).T * scaling`` in fp32, then
  ``weight += delta.to(weight.dtype)``: rounded to the output dtype *before* the add (twice rounded, unlike Linear).
- DoRA (``DoraLinearVariant.merge_unsafe``, ``DoraLinearLayer.get_weight_norm``): with ``delta`` as above,
  ``norm = linalg.norm(transpose(W, fifo) + 1 * transpose(delta, fifo), dim=1)`` (fp32, W the unmerged weight),
  ``factor = transpose((magnitude / norm).view(-1, 1), fifo)``, ``W' = (factor * (W + delta)).to(W.dtype)``.
  Embeddings: ``norm`` over ``W.T + 1 * delta.T``, ``factor = (magnitude / norm).view(1, -1)``.
- ``lora_bias``: ``bias += lora_B.bias * scaling`` (in place, fp32 compute).
- Trainable tokens (``trainable_token_indices``; ``TrainableTokensLayer.merge``): ``W.index_copy(0, indices,
  delta.to(W))``: the saved rows replace those rows of the embedding (or head), each cast once to the output dtype.
  A list names the input embeddings; on a tied model peft gives the head a token adapter tied to the embedding's
  (same rows, same values), a dict whose tied layers have other indices gives each its own.

Tied bases. Where the base ties its head to its input embeddings, the trained adapter model reads one tied
parameter for both, loaded with any saved embedding weight, and changes each through its own wrapper: a LoRA delta
or a ``modules_to_save`` copy changes only the module it is on, trainable tokens on both (tied adapter) or on one.
peft's merge of such a model writes into the shared parameter, which is not that model; the model that was trained
is peft's merge of the base untied after loading (the head a copy of the tied parameter as loaded):
:func:`untie_reason` tells when the two tensors then differ, :func:`tied_targets` what each gets.

Every step is the same torch op on tensors of the same shape, dtype and strides as peft's, on the same device,
so reductions (the matmul, the norm) run in the same order: the merge is bit for bit, not just close.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..dtypes import DTYPES
from ..errors import CheckpointError
from ..files import ADAPTER_WEIGHTS, inside
from ..safetensors_io.read import TensorInfo, read_header
from ..strict_json import strict_json
from . import conv1d

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = ADAPTER_WEIGHTS
PEFT_PREFIX = "base_model.model."

# peft.LoraConfig's defaults for the fields the merge reads (importing peft costs ~10 s; tests check these).
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
# variants, layers added or copied (layer_replication, target_parameters, trainable tokens), Megatron layers, and
# which modules get LoRA beyond target_modules (peft would leave some saved tensors unused). Each maps to "set" as
# peft 0.21 tests it: ``is not None`` where it does (for the sub-configs, _get_lora_subconfig refuses any other
# non-null value), else truthiness (``if config.layer_replication:``, resolve_lora_variant's ``bool(...)``).
# layers_pattern only qualifies layers_to_transform: _read_config refuses it where peft does.
UNSUPPORTED_VARIANTS = {
    "velora_config": _not_none,
    "alora_invocation_tokens": _truthy,
    "monteclora_config": _sub_config,
    "use_bdlora": _not_none,
    "arrow_config": _not_none,
    "kasa_config": _not_none,
    "use_qalora": _truthy,
    "layer_replication": _truthy,
    "target_parameters": _truthy,
    "megatron_config": _truthy,
    "exclude_modules": _truthy,
    "layers_to_transform": _layer_indexes,
}

# init_lora_weights strings peft knows that only say how a new adapter starts (LoraLayer.update_layer; and
# "gaussian" in any case, reset_lora_parameters); _base_mutating() tells the others.
PLAIN_INITS = ("eva", "orthogonal")

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


def _is_embedding(module: str) -> bool:
    return module.rpartition(".")[2] in EMBEDDING_MODULES


def _vocabulary(module: str) -> bool:
    """Whether ``module`` has a row per token (input embeddings or output head), which resizing the vocabulary grows."""
    return _is_embedding(module) or module.rpartition(".")[2] == HEAD.partition(".")[0]


def changes_vocabulary(target: LoraTarget) -> bool:
    """Whether a target changes embeddings or the head through a wrapper of its own (LoRA, a modules_to_save copy,
    trainable tokens): on a tied base that makes the head differ from the input embeddings."""
    return _vocabulary(target.module) and target.kind != "bias" and not _in_place(target)


def vocabulary_rows(adapter: Adapter, shapes: dict) -> int | None:
    """The vocabulary an adapter was trained with, where it saved its embeddings or head with more rows than the base
    (``shapes``: base tensor name -> shape) after resizing them; None where it did not. Call after :func:`validate`."""
    rows = {
        info.shape[0]
        for name, target in adapter.targets.items()
        if (info := target.tensors.get("base")) is not None
        and name in shapes
        and _vocabulary(target.module)
        and info.shape[0] != _shape_of(shapes[name])[0]
    }
    if len(rows) > 1:
        raise CheckpointError(
            f"{adapter.path}: saves embeddings or heads of {sorted(rows)} rows: one vocabulary size expected"
        )
    return rows.pop() if rows else None


def _lazy_classes(config: dict | None):
    """module path -> the class transformers' model has there, or None; the model built on the first question."""
    built = []

    def module_class(module: str):
        if not built:
            from ..skeleton import meta_model

            built.append(meta_model(config)[0])
        return built[0](module)

    return module_class


def _other_kind(target, module_class) -> bool:
    """Whether ``target``'s LoRA tensors are of the other kind than its layer's (EMBEDDING_MODULES says how that is
    known): peft would load none of them there."""
    if target.kind == "linear":
        return _is_embedding(target.module)
    if _is_embedding(target.module):
        return False
    import torch

    layer = module_class(target.module)
    return layer is None or not issubclass(layer, torch.nn.Embedding)


def _base_mutating(init) -> bool:
    """init_lora_weights values after which the adapter only fits a base model that the init rewrote (PiSSA, OLoRA,
    CorDA, LoftQ and LoRA-GA subtract their initial delta from the base weights), or that select another variant
    (MiCA): tested as peft's ``LoraLayer.update_layer`` tests them (prefixes, and some without case)."""
    if not isinstance(init, str):
        return False
    return init.startswith(("pissa", "corda")) or init.lower() in ("olora", "mica") or init in ("loftq", "lora_ga")


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

    kind: "linear" (LoRA/DoRA on a Linear or Conv1D weight), "embedding" (on an Embedding weight), "bias"
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


@dataclass
class Adapter:
    folder: Path
    path: Path  # adapter_model.safetensors
    config: dict
    base_model_name_or_path: str | None
    targets: dict[str, LoraTarget]  # base tensor name -> target
    tensors: dict[str, TensorInfo]  # every tensor of the adapter file


def _pattern_value(patterns: dict, module: str, default, config_path: Path, what: str):
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


def _number(value, config_path: Path, what: str, *, integer: bool):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise CheckpointError(f"{config_path}: {what} is {value!r}, not a{'n integer' if integer else ' number'}")
    if value <= 0 and integer:
        raise CheckpointError(f"{config_path}: {what} is {value}, it must be positive")
    if not math.isfinite(value):
        raise CheckpointError(f"{config_path}: {what} is {value}, not a finite number")
    return value


def _read_config(folder: Path) -> tuple[Path, dict]:
    # the checkpoint's rule for links: a Hub cache snapshot may read its repo's blobs, nothing may read outside
    config_path = inside(folder, CONFIG_NAME, what="adapter")
    try:
        raw = config_path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{config_path}: missing (not a peft adapter folder)") from None
    except OSError as error:
        raise CheckpointError(f"{config_path}: cannot be read ({error.strerror or error})") from None
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
    for entry in saved or ():  # peft matches each entry as a regular expression (_saved_whole)
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
    targets = config.get("target_modules")
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


def _indices_for(config: dict, module: str, config_path: Path) -> tuple[int, ...]:
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


def _all_linear(targets) -> bool:
    return (
        isinstance(targets, str) and targets.lower() == "all-linear"
    )  # peft's INCLUDE_LINEAR_LAYERS_SHORTHAND, any case


def _targeted(config: dict, module: str) -> bool:
    """Whether peft gives ``module`` (a dotted path) LoRA layers under ``target_modules``
    (``tuners_utils.check_target_module_exists``): a string is a full-match pattern, except "all-linear"
    (every Linear/Conv1D layer but the output layer); a list names module path suffixes."""
    targets = config["target_modules"]
    if _all_linear(targets):
        return module.rpartition(".")[2] != "lm_head" and not _is_embedding(module)
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == key or module.endswith("." + key) for key in targets)


def _saved_whole(config: dict, module: str) -> str | None:
    """The ``modules_to_save`` entry under which peft gives ``module`` (a dotted path) no LoRA layer, or None: as
    ``tuners_utils.check_target_module_exists``, an entry is a regular expression matched against whole components
    of the path, so it names the module itself or any module above it (_read_config checked that each compiles)."""
    for entry in config.get("modules_to_save") or ():
        if re.match(rf"(^|.*\.){entry}($|\..*)", module):
            return entry
    return None


def load_adapter(folder: Path) -> Adapter:
    """Read ``adapter_config.json`` and the header of ``adapter_model.safetensors`` (no tensor data) of a peft
    LoRA adapter, and map every base tensor it changes to a :class:`LoraTarget`.

    >>> adapter = load_adapter(Path("my-qlora-adapter"))
    >>> adapter.targets["model.layers.0.self_attn.q_proj.weight"].scaling
    2.0
    """
    folder = Path(folder)
    config_path, config = _read_config(folder)
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

    for module, roles in lora_modules.items():
        if not _targeted(config, module):  # peft would create no LoRA layer there and leave these tensors unused
            raise CheckpointError(
                f"{path}: tensor '{next(iter(roles.values())).name}' is for '{module}', which "
                f"target_modules {config['target_modules']!r} does not name"
            )
        if (entry := _saved_whole(config, module)) is not None:
            where = "is in" if module == entry or module.endswith("." + entry) else f"lies in '{entry}' of"
            raise CheckpointError(
                f"{path}: '{module}' has LoRA tensors and {where} modules_to_save too (peft gives it "
                "no LoRA layer and would leave them unused)"
            )
    targets: dict[str, LoraTarget] = {}
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
        if module in lora_modules or _saved_whole(config, module) is not None:
            raise CheckpointError(
                f"{path}: '{module}' has trainable tokens and LoRA tensors or modules_to_save too; peft refuses that"
            )
        target = LoraTarget(
            f"{module}.weight",
            "tokens",
            module=module,
            tensors={"trainable_tokens_delta": info},
            indices=_indices_for(config, module, config_path),
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
            name, "replace", module=module, tensors={"base": info}, saved_whole=_saved_whole(config, module) is not None
        )

    if config["ensure_weight_tying"] and any(t.kind in ("embedding", "replace", "tokens") for t in targets.values()):
        raise CheckpointError(
            f"{config_path}: ensure_weight_tying with adapted embeddings or modules_to_save: "
            "not mergeable tensor by tensor"
        )
    base = config.get("base_model_name_or_path")
    return Adapter(folder, path, config, base if isinstance(base, str) else None, targets, tensors)


def _module_targets(path: Path, config_path: Path, config: dict, module: str, roles: dict) -> list[LoraTarget]:
    """The targets of one LoRA module (its weight, and its bias with lora_bias), checked against the config."""
    r = _pattern_value(config["rank_pattern"], module, config["r"], config_path, "rank_pattern")
    r = _number(r, config_path, f"r for '{module}'", integer=True)
    alpha = _pattern_value(config["alpha_pattern"], module, config["lora_alpha"], config_path, "alpha_pattern")
    alpha = _number(alpha, config_path, f"lora_alpha for '{module}'", integer=False)
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


def _shape_of(value) -> tuple:
    """A base entry: a shape, a tuple whose first item is the shape, or anything with ``.shape``."""
    if hasattr(value, "shape"):
        return tuple(value.shape)
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], (tuple, list)):
        return tuple(value[0])
    return tuple(value)


def validate(adapter: Adapter, base: dict, *, config: dict | None = None) -> Adapter:
    """Check the adapter against the base checkpoint before anything is written; one-line CheckpointError for
    each problem: a target the base lacks, LoRA tensors of the other kind than the layer's (embedding-style on a
    Linear/Conv1D, linear-style on an embedding: see EMBEDDING_MODULES), a LoRA factor, magnitude or replacement
    whose shape does not fit the base tensor's. ``base`` maps every base tensor name to its dense shape (or
    ``(shape, ...)``, or an object with ``.shape``). Resolves each linear target's ``fan_in_fan_out`` as peft does,
    updating ``adapter.targets``, and returns the adapter.

    peft sets ``fan_in_fan_out`` from the layer's class, whatever the config says: True for a ``Conv1D``
    (GPT-2; weight stored (in, out)), False for ``nn.Linear`` (weight (out, in)). The shapes tell which one a
    non-square weight is. A square weight is a Conv1D's where ``conv1d`` says so for the model of ``config``
    (config.json); in another architecture it takes the orientation that all non-square targets agree on, and
    Linear's when they disagree or there are none.
    """
    path = adapter.path
    orientation: dict[str, bool | None] = {}  # linear target -> fan_in_fan_out, None for a square weight
    classes = _lazy_classes(config)
    for name, target in adapter.targets.items():
        if name not in base:
            hint = ""
            for other in (f"model.{name}", name.removeprefix("model.")):
                if other != name and other in base:
                    hint = f" (it has '{other}': was the adapter trained on another model class?)"
            some = next(iter(target.tensors.values())).name
            raise CheckpointError(f"{path}: '{some}' changes '{name}', which the base checkpoint does not have{hint}")
        if target.kind in ("linear", "embedding") and _other_kind(target, classes):
            style, layer = "embedding-style (lora_embedding_A/B)", "is a Linear/Conv1D layer of the base model"
            if target.kind == "linear":
                style, layer = "linear-style (lora_A/B)", "is an embedding layer of the base model"
            elif classes(target.module) is None:
                layer = (
                    "is not named like an embedding, and transformers cannot build the model from its config.json "
                    "to tell its class"
                )
            raise CheckpointError(
                f"{path}: the LoRA tensors for '{target.module}' are {style}, but '{target.module}' "
                f"{layer} (peft would load none of them into another kind of layer)"
            )
        shape = _shape_of(base[name])
        replacement = target.tensors.get("base")
        if replacement is not None and tuple(replacement.shape) != shape:
            if not _vocabulary(target.module) or len(shape) != 2 or tuple(replacement.shape[1:]) != shape[1:]:
                raise CheckpointError(
                    f"{path}: tensor '{replacement.name}' is {list(replacement.shape)}, "
                    f"the base's '{name}' is {list(shape)}"
                )
            if replacement.shape[0] < shape[0]:
                raise CheckpointError(
                    f"{path}: tensor '{replacement.name}' has {replacement.shape[0]} rows, fewer than the "
                    f"{shape[0]} of the base's '{name}': an adapter can add tokens, not remove them"
                )
            shape = tuple(replacement.shape)  # a resized vocabulary: the adapter's rows are the model's
        if target.kind == "replace":
            continue
        if target.kind == "tokens":
            delta, rows = target.tensors["trainable_tokens_delta"], len(target.indices)
            if len(shape) != 2 or tuple(delta.shape) != (rows, shape[1]):
                raise CheckpointError(
                    f"{path}: tensor '{delta.name}' is {list(delta.shape)}, {rows} trainable tokens of "
                    f"the base's '{name}' {list(shape)} need [{rows}, {shape[-1]}]"
                )
            outside = [i for i in target.indices if not 0 <= i < shape[0]]
            if outside:
                raise CheckpointError(
                    f"{path}: trainable_token_indices for '{target.module}' has {outside[0]}, outside "
                    f"the {shape[0]} rows of the base's '{name}'"
                )
            continue
        if target.kind == "bias":
            lora_bias = target.tensors["lora_B.bias"]
            if len(shape) != 1 or tuple(lora_bias.shape) != shape:
                raise CheckpointError(
                    f"{path}: tensor '{lora_bias.name}' is {list(lora_bias.shape)}, "
                    f"the base's '{name}' is {list(shape)}"
                )
            continue
        if target.kind == "linear":
            lora_a, lora_b = target.tensors["lora_A"], target.tensors["lora_B"]
            out_features, in_features = lora_b.shape[0], lora_a.shape[1]
            if shape == (out_features, in_features) and shape == (in_features, out_features):
                orientation[name] = None
            elif shape == (out_features, in_features):
                orientation[name] = False
            elif shape == (in_features, out_features):
                orientation[name] = True
            else:
                raise CheckpointError(
                    f"{path}: '{lora_a.name}' {list(lora_a.shape)} and '{lora_b.name}' {list(lora_b.shape)} "
                    f"do not fit the base's '{name}' {list(shape)}"
                )
        else:
            lora_a, lora_b = target.tensors["lora_embedding_A"], target.tensors["lora_embedding_B"]
            out_features = lora_b.shape[0]  # embedding_dim
            if len(shape) != 2 or shape != (lora_a.shape[1], lora_b.shape[0]):
                raise CheckpointError(
                    f"{path}: '{lora_a.name}' {list(lora_a.shape)} and '{lora_b.name}' {list(lora_b.shape)} "
                    f"do not fit the base's embedding '{name}' {list(shape)}"
                )
        magnitude = target.tensors.get("lora_magnitude_vector")
        if magnitude is not None and tuple(magnitude.shape) != (out_features,):
            raise CheckpointError(
                f"{path}: tensor '{magnitude.name}' is {list(magnitude.shape)}, the base's '{name}' {list(shape)} "
                f"needs [{out_features}]"
            )

    targets = adapter.config.get("target_modules")
    if not _all_linear(targets):  # "all-linear" spares embeddings, which shapes alone do not tell from linear layers
        # a module in modules_to_save too is saved whole, without LoRA tensors (peft loads and merges that as is)
        adapted = {t.module for t in adapter.targets.values() if t.kind in ("linear", "embedding", "replace")}
        for name, value in base.items():
            module = name.removesuffix(".weight")
            if (
                module != name
                and module not in adapted
                and len(_shape_of(value)) == 2
                and _targeted(adapter.config, module)
                and _saved_whole(adapter.config, module) is None
            ):
                raise CheckpointError(
                    f"{path}: target_modules {targets!r} names '{module}', but the adapter has no LoRA "
                    "tensors for it (peft would merge a freshly initialised LoRA layer there)"
                )

    known = {value for value in orientation.values() if value is not None}
    square_default = known.pop() if len(known) == 1 else False
    for name, fan_in_fan_out in orientation.items():
        if fan_in_fan_out is None:
            fan_in_fan_out = conv1d.is_conv1d_weight(name, config) if conv1d.uses_conv1d(config) else square_default
        if fan_in_fan_out != adapter.targets[name].fan_in_fan_out:
            adapter.targets[name] = dataclasses.replace(adapter.targets[name], fan_in_fan_out=fan_in_fan_out)
    return adapter


def read_lora(target: LoraTarget, reader) -> dict:
    """The adapter tensors of one target, as stored (CPU tensors), read with a checkpoint.TensorReader."""
    return {role: reader.tensor(info) for role, info in target.tensors.items()}


def _transpose(weight, fan_in_fan_out: bool):
    return weight.T if fan_in_fan_out else weight  # peft.utils.other.transpose


def merge(target: LoraTarget, base_weight, lora: dict, *, inplace: bool = False):
    """The merged tensor for ``target``: bit for bit what peft's ``merge_and_unload`` gives.

    ``base_weight`` is the dense base tensor in the output dtype on the conversion's device; ``lora`` holds the
    target's adapter tensors as stored (any device, any float dtype; see :func:`read_lora`). With ``inplace`` a
    plain LoRA delta is added into ``base_weight`` itself (saves a copy of a large embedding); otherwise
    ``base_weight`` is left as it was. The result has ``base_weight``'s dtype, shape and device. Peak memory:
    the weight plus about two fp32 copies of it.

    Where this departs from peft's literal code it is only to save memory, with the same bits: an in-place
    ``mul_`` for ``x * scaling`` (the same elementwise kernel), ``x.mul_(factor)`` for ``factor * x``
    (IEEE multiplication commutes), and no ``1 * x`` (exact, and its result has ``x``'s strides, so the norm
    reduces in the same order).
    """
    import torch

    out_dtype, device = base_weight.dtype, base_weight.device

    def fp32(role):  # autocast_adapter_dtype: every adapter parameter is fp32 on the base weight's device
        return lora[role].to(device=device, dtype=torch.float32)

    if "base" in lora:
        # load_state_dict copies the saved tensor into the base parameter: a cast to its dtype
        weight = lora["base"].to(device=device, dtype=out_dtype)
        owned = weight is not lora["base"]
    else:
        weight, owned = base_weight, inplace

    def writable():
        return weight if owned else weight.clone()

    if target.kind == "replace":
        return writable()
    if target.kind == "tokens":  # TrainableTokensLayer.merge: a new tensor with the saved rows copied in
        index = torch.tensor(target.indices).to(device)
        return weight.index_copy(0, index, lora["trainable_tokens_delta"].to(weight))
    if target.kind == "bias":
        merged = writable()
        merged += fp32("lora_B.bias") * target.scaling  # not mul_: fp32() may return the caller's tensor
        return merged

    if target.kind == "linear":
        fan_in_fan_out = target.fan_in_fan_out
        delta = _transpose(fp32("lora_B") @ fp32("lora_A"), fan_in_fan_out).mul_(target.scaling)
        if not target.use_dora:
            merged = writable()
            merged += delta  # Linear.merge: fp32 delta into the low-precision weight, one rounding
            return merged
        # DoraLinearVariant.merge_unsafe; get_weight_norm gets the delta (scaling already in it) with scaling=1
        weight_sum = _transpose(weight, fan_in_fan_out) + _transpose(delta, fan_in_fan_out)
        weight_norm = torch.linalg.norm(weight_sum, dim=1).to(weight_sum.dtype)
        del weight_sum
        dora_factor = fp32("lora_magnitude_vector") / weight_norm
        dora_factor = _transpose(dora_factor.view(-1, 1), fan_in_fan_out)
        return delta.add_(weight).mul_(dora_factor).to(out_dtype)

    # embedding: Embedding.get_delta_weight is transpose(B @ A, True) * scaling
    delta = (fp32("lora_embedding_B") @ fp32("lora_embedding_A")).T.mul_(target.scaling)
    if not target.use_dora:
        merged = writable()
        merged += delta.to(out_dtype)  # Embedding.merge casts the delta first, unlike Linear.merge
        return merged
    # DoraEmbeddingVariant.merge_unsafe: DoraEmbeddingLayer has fan_in_fan_out=True and gets delta.T
    weight_sum = weight.T + delta.T
    weight_norm = torch.linalg.norm(weight_sum, dim=1).to(weight_sum.dtype)
    del weight_sum
    dora_factor = (fp32("lora_magnitude_vector") / weight_norm).view(1, -1)
    return delta.add_(weight).mul_(dora_factor).to(out_dtype)


def untie_reason(adapter: Adapter, embedding: str, head: str = HEAD) -> str | None:
    """For a base whose head ``head`` is tied to its input embeddings ``embedding`` (tensor names): why the model that
    was trained has a head that differs from its input embeddings, or None where they are still one tensor.

    The trained model reads one tied parameter (loaded with any weight saved in place for either) through wrappers:
    LoRA on either, or a ``modules_to_save`` copy of either, changes that one only; trainable tokens change both
    alike where peft ties the head's token adapter to the embeddings' (:func:`_tied_tokens`), else each its own."""
    emb, out = adapter.targets.get(embedding), adapter.targets.get(head)
    tied_tokens = _tied_tokens(adapter, emb)
    if out is not None and not (out.kind == "tokens" and tied_tokens) and not _in_place(out):
        what = {"replace": "replaces (modules_to_save)", "tokens": "trains tokens of"}.get(out.kind, "puts LoRA on")
        return f"the adapter {what} the output head ({out.module}) and not the input embeddings"
    if emb is None or _in_place(emb) or tied_tokens:
        return None
    what = {"replace": "replaces (modules_to_save)", "tokens": "trains tokens of", "embedding": "puts LoRA on"}[
        emb.kind
    ]
    return f"the adapter {what} the input embeddings ({emb.module}) and not the head"


def _in_place(target: LoraTarget) -> bool:
    """A weight saved in place of the module's own (save_embedding_layers): on a tied base, the tied parameter's."""
    return target.kind == "replace" and not target.saved_whole


def _tied_tokens(adapter: Adapter, embedding: LoraTarget | None) -> bool:
    """Whether peft gives the head a token adapter tied to the input embeddings' (set_additional_trainable_modules):
    trainable tokens on the embeddings from a list, or from a dict whose entry for the head, if any, has the same
    rows."""
    if embedding is None or embedding.kind != "tokens":
        return False
    indices = adapter.config["trainable_token_indices"]
    if not isinstance(indices, dict):
        return True
    module = HEAD.rpartition(".")[0]
    return all(tuple(value) == embedding.indices for key, value in indices.items() if module.endswith(key))


def tied_targets(adapter: Adapter, embedding: str, head: str = HEAD) -> tuple[LoraTarget | None, LoraTarget | None]:
    """What the input embeddings and the head of a tied base get, each starting from the embeddings' base tensor.

    peft loads every weight saved in place for either (an embedding's ``base_layer.weight``, save_embedding_layers'
    ``embed_tokens.weight`` / ``lm_head.weight``) into the one tied parameter, in module order, the head's last; a
    ``modules_to_save`` module has its own copy; a tied token adapter's rows are the embeddings' (peft loads those)."""
    emb, out = adapter.targets.get(embedding), adapter.targets.get(head)
    loaded = None
    for target in (emb, out):
        if target is not None and "base" in target.tensors and not (target.kind == "replace" and target.saved_whole):
            loaded = target.tensors["base"]

    def starting(target: LoraTarget | None, name: str) -> LoraTarget | None:
        if target is not None and target.kind == "replace" and target.saved_whole:
            return target
        if target is None or target.kind == "replace":
            return (
                None
                if loaded is None
                else LoraTarget(name, "replace", module=name.rpartition(".")[0], tensors={"base": loaded})
            )
        own = {role: info for role, info in target.tensors.items() if role != "base"}
        return dataclasses.replace(target, tensors={**own, **({"base": loaded} if loaded is not None else {})})

    return starting(emb, embedding), starting(out, head)
