"""An adapter against the base it is merged into: every target there, of the right shape, rank and layer kind
(Linear, Conv1D or Embedding, as peft decides), refused in one line before anything is written."""

from __future__ import annotations

import dataclasses

from ..errors import CheckpointError
from ..model import conv1d
from . import params as peft_params
from .config import all_linear, is_embedding, saved_whole, targeted
from .lora import Adapter, per_token, shape_of


def _lazy_model(config: dict | None):
    """(module path -> the class transformers' model has there, module path -> that module on the meta device), each
    None where there is none; the model built on the first question."""
    built = []

    def asked(which: int):
        def answer(module: str):
            if not built:
                from ..model.skeleton import meta_model

                built.append(meta_model(config))
            return built[0][which](module)

        return answer

    return asked(0), asked(3)


def _other_kind(target, module_class) -> bool:
    """Whether ``target``'s LoRA tensors are of the other kind than its layer's (EMBEDDING_MODULES says how that is
    known): peft would load none of them there."""
    if target.kind == "linear":
        return is_embedding(target.module)
    if is_embedding(target.module):
        return False
    import torch

    layer = module_class(target.module)
    return layer is None or not issubclass(layer, torch.nn.Embedding)


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
    classes, modules = _lazy_model(config)
    peft_params.resolve(adapter, base, modules)
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
        shape = shape_of(base[name])
        replacement = target.tensors.get("base")
        if replacement is not None and tuple(replacement.shape) != shape:
            if not per_token(target.module) or len(shape) != 2 or tuple(replacement.shape[1:]) != shape[1:]:
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
        if target.kind in ("replace", "param"):  # a parameter's LoRA was checked as it was resolved
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
    if not all_linear(targets):  # "all-linear" spares embeddings, which shapes alone do not tell from linear layers
        # a module in modules_to_save too is saved whole, without LoRA tensors (peft loads and merges that as is)
        adapted = {t.module for t in adapter.targets.values() if t.kind in ("linear", "embedding", "replace")}
        for name, value in base.items():
            module = name.removesuffix(".weight")
            if (
                module != name
                and module not in adapted
                and len(shape_of(value)) == 2
                and targeted(adapter.config, module)
                and saved_whole(adapter.config, module) is None
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
