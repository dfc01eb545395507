"""The reference of a merged tensor: peft's own merge. The tensor's module alone, in a stand-in model holding the
references of its base tensors, then ``PeftModel.from_pretrained(...).merge_and_unload()``: what the user's route
runs, with none of our merge code. A merge needs the whole tensor: one slice, the one tensor held (on the GPU where
verify runs there)."""

from __future__ import annotations

import dataclasses
import warnings

from ...dtypes import DTYPES
from .base import Slice, as_bytes
from .base import against as base_against


def against(tensor, device) -> str:
    return f"{base_against(dataclasses.replace(tensor, recipe=tensor.recipe.base), device)} + peft"


def slices(tensor, reader, device, context, piece_bytes: int):
    yield Slice(0, tensor.nbytes, lambda read, take: as_bytes(reference(tensor, reader, device, context)))


def _skeleton_module(module: str, adapter, device, dtype, references: dict, layer_class, meta_layer=None):
    """A stand-in for one module of the base model holding ``references`` (its tensors, by full name): the layer
    class the model has there (``layer_class``, read from transformers' own model on the meta device: Linear,
    Conv1D or Embedding, which decides what peft does), or a plain holder for a modules_to_save module; for LoRA on
    its parameters (target_parameters), transformers' module itself (``meta_layer``: the parameters it registers, in
    its order, and its layout of experts, which decide what peft wraps and how). peft then does all of the merging."""
    import copy

    import torch

    if any(t.module == module and t.kind == "param" for t in adapter.targets.values()):
        if meta_layer is None:
            raise RuntimeError(f"transformers' model has no module '{module}' to wrap its parameters as peft does")
        layer = copy.deepcopy(meta_layer)
        for name, _ in list(layer.named_parameters(recurse=False)):
            value = references.get(f"{module}.{name}")
            if value is None:
                raise RuntimeError(f"'{module}.{name}' is not in the checkpoint to stand in for the model's")
            setattr(layer, name, torch.nn.Parameter(value, requires_grad=False))
        return layer

    lora = next((t for t in adapter.targets.values() if t.module == module and t.kind in ("linear", "embedding")), None)
    params = {name.rpartition(".")[2]: value for name, value in references.items()}
    tokens = any(t.module == module and t.kind == "tokens" for t in adapter.targets.values())
    if tokens and lora is None and "weight" in params:  # peft's token adapter reads the layer's kind and sizes
        rows, columns = params["weight"].shape
        if layer_class is not None and issubclass(layer_class, torch.nn.Embedding):
            layer = torch.nn.Embedding(rows, columns, device="meta")
        else:
            layer = torch.nn.Linear(columns, rows, bias="bias" in params, device="meta")
        for name, value in params.items():
            setattr(layer, name, torch.nn.Parameter(value, requires_grad=False))
        return layer
    # The layer transformers' model has there, whatever kind of LoRA tensors the adapter holds: peft loads those of
    # the kind its layer calls for only, so a mismatch shows as a weight peft leaves unchanged.
    embedding = lora is not None and (
        lora.kind == "embedding" if layer_class is None else issubclass(layer_class, torch.nn.Embedding)
    )
    if lora is not None:  # the base weight's shape, (out, in) / (rows, columns), from the LoRA factors of either kind
        first, second = (
            lora.tensors[role]
            for role in (("lora_embedding_A", "lora_embedding_B") if lora.kind == "embedding" else ("lora_B", "lora_A"))
        )
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


def reference(tensor, reader, device, context):
    """peft's own merge: the tensor's module in a stand-in model holding the bitsandbytes reference of its base
    tensors, then ``PeftModel.from_pretrained(...).merge_and_unload()`` (what the user's route runs). Beside it stand
    the modules peft must find (every one trainable_token_indices names, a LoRA target), and on a tied base the
    embeddings and head share one parameter while peft loads the adapter, then are untied and merged apart: the
    model that was trained."""
    import torch
    from peft import PeftConfig, PeftModel

    recipe = tensor.recipe
    module = tensor.name.rpartition(".")[0]
    wanted = {module} | {t.module for t in recipe.adapter.targets.values() if t.kind == "tokens"}
    pair = [name.rpartition(".")[0] for name in context.tied]
    if module in pair:
        wanted |= set(pair)
    references = {}  # every planned tensor of those modules (a weight and, with lora_bias, its bias) is rebuilt
    for name, sibling in context.planned.items():
        if name.rpartition(".")[0] not in wanted:
            continue
        if sibling.recipe.kind == "merge_lora" and "base" in sibling.recipe.target.tensors:
            # peft loads the adapter's saved weight over it, of the adapter's rows: only the shape counts
            references[name] = torch.zeros(sibling.shape, dtype=DTYPES[sibling.dtype].torch, device=device)
            continue
        base = sibling.recipe.base if sibling.recipe.kind == "merge_lora" else sibling.recipe
        recomputed = context.recompute(dataclasses.replace(sibling, recipe=base), reader, device)
        references[name] = recomputed.to(device).reshape(sibling.shape)
    dtype = DTYPES[tensor.dtype].torch
    root = torch.nn.Module()
    modules = {}
    # a causal LM registers its head after the base model, so peft loads into the tied parameter the head's weight last
    for path in sorted(wanted, key=lambda path: (bool(pair) and path == pair[1], path)):
        held = {name: value for name, value in references.items() if name.rpartition(".")[0] == path}
        layer_class, meta_layer = context.module_class(path), context.module(path)
        modules[path] = _skeleton_module(path, recipe.adapter, device, dtype, held, layer_class, meta_layer)
    if module in pair:  # tied, as the trained model loaded it
        if "weight" not in modules[pair[1]]._parameters:  # a head the output keeps tied: a Linear, as the model has
            rows, columns = modules[pair[0]].weight.shape
            modules[pair[1]] = torch.nn.Linear(columns, rows, bias=False, device="meta")
        modules[pair[1]].weight = modules[pair[0]].weight
    if not any(
        t.module in modules and t.kind in ("linear", "embedding", "param") for t in recipe.adapter.targets.values()
    ):
        # peft refuses a model with no LoRA target, so one stands beside
        lora = next(t for t in recipe.adapter.targets.values() if t.kind in ("linear", "embedding"))
        modules[lora.module] = _skeleton_module(
            lora.module, recipe.adapter, device, dtype, {}, context.module_class(lora.module)
        )
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
    head_tokens = (
        any(t.module == pair[1] and t.kind == "tokens" for t in recipe.adapter.targets.values()) if pair else False
    )
    if module in pair and isinstance(config.trainable_token_indices, list) and head_tokens:
        # peft ties a tied model's head token adapter to the embeddings' (a bare tree has no config saying so), whose
        # keys the adapter saved too: the same rows on both, each loading its keys (the head's base weight last)
        config.trainable_token_indices = {
            pair[0]: config.trainable_token_indices,
            pair[1]: config.trainable_token_indices,
        }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = PeftModel.from_pretrained(
            root, str(recipe.adapter.folder), config=config, torch_device=str(device)
        )
        if module in pair:  # each merged apart, as the trained model's two wrappers read them
            _untie(peft_model, *context.tied)
        merged = peft_model.merge_and_unload()
    return merged.get_parameter(tensor.name).detach()


def _untie(peft_model, embedding: str, head: str) -> None:
    """The head module (under whatever peft wrapped it in) given its own copy of the parameter it shares with the
    embeddings, as loaded: the trained model's head, now apart from what the merge does to the embeddings."""
    import torch

    modules = dict(peft_model.named_modules(remove_duplicate=False))
    shared = {
        id(layer._parameters["weight"])
        for name, layer in modules.items()
        if embedding.rpartition(".")[0] in name and layer._parameters.get("weight") is not None
    }
    for name, layer in modules.items():
        held = layer._parameters.get("weight")
        if head.rpartition(".")[0] in name and held is not None and id(held) in shared:
            layer.weight = torch.nn.Parameter(held.detach().clone(), requires_grad=False)
