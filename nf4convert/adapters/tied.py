"""Tied bases. Where the base ties its head to its input embeddings, the trained adapter model reads one tied
parameter for both, loaded with any saved embedding weight, and changes each through its own wrapper: a LoRA delta
or a ``modules_to_save`` copy changes only the module it is on, trainable tokens on both (tied adapter) or on one.
peft's merge of such a model writes into the shared parameter, which is not that model; the model that was trained
is peft's merge of the base untied after loading (the head a copy of the tied parameter as loaded):
:func:`untie_reason` tells when the two tensors then differ, :func:`tied_targets` what each gets.
"""

from __future__ import annotations

import dataclasses

from ..errors import CheckpointError
from .lora import HEAD, Adapter, LoraTarget, per_token, shape_of


def changes_vocabulary(target: LoraTarget) -> bool:
    """Whether a target changes embeddings or the head through a wrapper of its own (LoRA, a modules_to_save copy,
    trainable tokens): on a tied base that makes the head differ from the input embeddings."""
    return per_token(target.module) and target.kind != "bias" and not _in_place(target)


def vocabulary_rows(adapter: Adapter, shapes: dict) -> int | None:
    """The vocabulary an adapter was trained with, where it saved its embeddings or head with more rows than the base
    (``shapes``: base tensor name -> shape) after resizing them; None where it did not. Call after
    ``peft_checks.validate``."""
    rows = {
        info.shape[0]
        for name, target in adapter.targets.items()
        if (info := target.tensors.get("base")) is not None
        and name in shapes
        and per_token(target.module)
        and info.shape[0] != shape_of(shapes[name])[0]
    }
    if len(rows) > 1:
        raise CheckpointError(
            f"{adapter.path}: saves embeddings or heads of {sorted(rows)} rows: one vocabulary size expected"
        )
    return rows.pop() if rows else None


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
