"""LoRA on parameters (peft's ``target_parameters``, its ``lora.ParamWrapper``), as on gpt-oss's fused experts: which
parameter each saved LoRA changes, and its rank, scaling and layout, settled against the base model.

peft wraps a module once per parameter that target_parameters names, in the order the module registers them, each
wrapper around the one before: the first registered is innermost, and its tensors are saved under ``.base_layer`` once
per wrapper outside it. A 3-D parameter holds one matrix per expert, ``[experts, in, out]`` where the module says
``is_transposed`` (gpt-oss) and ``[experts, out, in]`` otherwise; its LoRA factors stack the experts' ranks:
``lora_A`` ``[rank * experts, in]``, ``lora_B`` ``[out, rank * experts]``. The merge is ``peft_merge.merge``'s.
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import CheckpointError
from .config import number, parameter_targets, pattern_value
from .lora import Adapter, shape_of


def resolve(adapter: Adapter, base: dict, module_of) -> None:
    """Name each "param" target of ``adapter`` (saved under its module's path) by the base tensor it changes, with its
    rank, scaling, experts and layout; ``base`` maps every base tensor name to its shape, ``module_of(path)`` gives
    transformers' module there (on the meta device), or None. CheckpointError, in one line, for a parameter the base
    or the model lacks, a LoRA whose shapes do not fit it, one peft would not merge as a ParamWrapper does, and a
    parameter target_parameters names that the adapter holds no LoRA for."""
    path, config = adapter.path, adapter.config
    pending = {key: target for key, target in adapter.targets.items() if target.kind == "param"}
    resolved = {}
    for key, target in pending.items():
        module = target.module
        layer = module_of(module)
        if layer is None:
            raise CheckpointError(
                f"{path}: '{next(iter(target.tensors.values())).name}' is LoRA on a parameter of '{module}', which the "
                "model transformers builds from config.json does not have (or it cannot be built)"
            )
        named = parameter_targets(config, module)
        order = [name for name, _ in layer.named_parameters(recurse=False) if name in named]
        if target.depth >= len(order):
            raise CheckpointError(
                f"{path}: '{target.tensors['lora_A'].name}' lies inside {target.depth} parameter wrappers, but "
                f"target_parameters names {len(order)} parameter(s) of '{module}'"
            )
        name = f"{module}.{order[len(order) - 1 - target.depth]}"
        shape = shape_of(base[name]) if name in base else None
        if shape is None or len(shape) != 3 or shape[0] < 2:
            what = "not in the base checkpoint" if shape is None else f"{list(shape)}"
            raise CheckpointError(
                f"{path}: target_parameters names '{name}' ({what}); only LoRA on 3-D parameters of several experts "
                "can be merged"
            )
        transposed = bool(getattr(layer, "is_transposed", False))
        experts, in_features, out_features = shape if transposed else (shape[0], shape[2], shape[1])
        rank = pattern_value(config["rank_pattern"], name, config["r"], path, "rank_pattern")
        rank = number(rank, path, f"r for '{name}'", integer=True)
        alpha = pattern_value(config["alpha_pattern"], name, config["lora_alpha"], path, "alpha_pattern")
        alpha = number(alpha, path, f"lora_alpha for '{name}'", integer=False)
        lora_a, lora_b = target.tensors["lora_A"], target.tensors["lora_B"]
        stacked = rank * experts
        if tuple(lora_a.shape) != (stacked, in_features) or tuple(lora_b.shape) != (out_features, stacked):
            raise CheckpointError(
                f"{path}: '{lora_a.name}' {list(lora_a.shape)} and '{lora_b.name}' {list(lora_b.shape)} do not fit "
                f"the base's '{name}' {list(shape)} at rank {rank}: [{stacked}, {in_features}] and "
                f"[{out_features}, {stacked}] expected"
            )
        scaling = alpha / math.sqrt(rank) if config["use_rslora"] else alpha / rank  # ParamWrapper.update_layer
        resolved[name] = dataclasses.replace(
            target, name=name, rank=rank, alpha=alpha, scaling=scaling, experts=experts, transposed=transposed
        )
    for key in pending:
        del adapter.targets[key]
    adapter.targets.update(resolved)
    if not config.get("target_parameters"):
        return
    for name, value in base.items():
        module, _, parameter = name.rpartition(".")
        if parameter in parameter_targets(config, module) and name not in adapter.targets:
            raise CheckpointError(
                f"{path}: target_parameters names '{name}', but the adapter has no LoRA tensors for it (peft would "
                "merge a freshly initialised one there)"
            )
