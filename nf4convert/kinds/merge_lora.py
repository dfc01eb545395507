"""Another recipe's tensor with a peft LoRA adapter's change merged in, bit for bit as peft merges it
(``adapters/lora.py`` reads the adapter and reproduces peft's arithmetic). A merge needs the whole base tensor:
it is made whole on the route's device, merged there, and written from memory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterator

from ..adapters import checks as peft_checks
from ..adapters import finite as peft_finite
from ..adapters import lora as peft_lora
from ..adapters import merge as peft_merge
from ..adapters import tied as peft_tied
from ..dtypes import DTYPES, DType
from ..errors import CheckpointError
from ..files import TOKENIZER_FILES, tokenizer_files
from ..model import config as model_config
from ..pipeline.piece import Piece
from .base import Added, Planning, Recipe, SideFiles, register, whole
from .untied import Untied


@register
@dataclass(frozen=True)
class MergeLora(Recipe):
    """Another recipe's tensor with a peft LoRA adapter's change merged in, bit for bit as peft merges it."""

    kind: ClassVar[str] = "merge_lora"
    label: ClassVar[str] = "merged with the adapter"
    order: ClassVar[int] = 200  # wraps whatever every other kind made
    merges_adapter: ClassVar[bool] = True
    base: Recipe
    target: peft_lora.LoraTarget
    adapter: peft_lora.Adapter = field(compare=False, repr=False)  # the whole adapter (verify rebuilds its module)
    keep_non_finite: bool = field(default=False, compare=False, repr=False)  # NaN/±inf it makes: kept, not refused
    non_finite: list = field(default_factory=list, compare=False, repr=False)  # what it made, where kept: one line each

    @classmethod
    def plan_output(cls, planning: Planning) -> None:
        """With an adapter: each recipe whose tensor it changes, wrapped in a merge (``planning.merged`` says what
        else the merge did)."""
        if planning.adapter is not None:
            planning.recipes, planning.merged = cls.wrap(
                planning.recipes, planning.adapter, planning.dtype, planning.config, planning.keep_non_finite
            )

    @classmethod
    def plan_files(cls, planning: Planning, files: SideFiles) -> SideFiles:
        """A resized vocabulary's tokenizer is the adapter's, in place of the base's as a set (the merge's record
        lists its files)."""
        merged = planning.merged
        found = tokenizer_files(merged.adapter.folder) if merged and merged.rows else []
        if not found:
            return files
        planning.merged = dataclasses.replace(merged, files=found)
        carried = [path for path in files.carried if path.as_posix() not in TOKENIZER_FILES]
        added = {
            path: Added(merged.adapter.folder / path, "the adapter's tokenizer file", "the adapter's") for path in found
        }
        return SideFiles(carried, {**files.added, **added})

    @classmethod
    def plan_config(cls, planning: Planning, config: dict) -> dict:
        """A head untied from the input embeddings, a vocabulary resized: as the merged model's config says."""
        merged = planning.merged
        if merged and merged.untied:
            config = model_config.untied_config(config)
        if merged and merged.rows:
            config = model_config.resized_config(config, merged.rows)
        return config

    @classmethod
    def wrap(
        cls,
        recipes: dict[str, Recipe],
        adapter_folder: Path | peft_lora.Adapter,
        dtype: DType,
        config: dict | None,
        keep_non_finite: bool = False,
    ) -> tuple[dict[str, Recipe], "Merged"]:
        """``recipes`` (anchor -> recipe, in output order) with each recipe whose tensor the adapter changes wrapped
        in a merge; the adapter is checked first. On a tied base the embeddings start from what peft loads into the
        tied parameter, and where the adapter makes the head differ from them, the head gets a tensor of its own: an
        Untied copy of the embeddings, merged with its change, right after them (under the head's name).
        ``keep_non_finite``: the NaN or ±inf values a merge makes are kept (listed on its ``non_finite``), not
        refused."""
        adapter = (
            adapter_folder if isinstance(adapter_folder, peft_lora.Adapter) else peft_lora.load_adapter(adapter_folder)
        )
        shapes = {name: shape for name, _, shape in (recipe.output(dtype) for recipe in recipes.values())}
        config = config if isinstance(config, dict) else {}
        head_name = peft_lora.HEAD
        tied = model_config.tied(config) and head_name not in shapes
        embedding = model_config.input_embedding(shapes, config) if tied else None
        if model_config.tied(config) and not tied:
            if peft_tied.untie_reason(adapter, model_config.input_embedding(shapes, config) or ""):
                # transformers ties such a head to the embeddings on load, ignoring the checkpoint's: neither is
                # what was trained
                raise CheckpointError(
                    f"{adapter.path}: changes lm_head or the input embeddings, which the base ties to its input "
                    f"embeddings (tie_word_embeddings) though it holds a '{head_name}' that transformers ignores on "
                    "load: not mergeable"
                )
        # a tied head is the embeddings' tensor: an adapter may change it (peft gives the model's lm_head its own)
        checked = {**shapes, head_name: shapes[embedding]} if embedding else shapes
        peft_checks.validate(adapter, checked, config=config)
        if tied and embedding is None and any(peft_tied.changes_vocabulary(t) for t in adapter.targets.values()):
            raise CheckpointError(
                f"{adapter.path}: changes lm_head or embeddings, and the base ties lm_head to its input embeddings "
                "(tie_word_embeddings) but has no one tensor named as them to untie it from"
            )
        rows = peft_tied.vocabulary_rows(adapter, checked)
        targets = dict(adapter.targets)
        reason = head = None
        if embedding:
            reason = peft_tied.untie_reason(adapter, embedding)
            targets[embedding], head = peft_tied.tied_targets(adapter, embedding)
            targets.pop(head_name, None)
        if rows is not None:  # rows nobody saved were drawn at random when the trainer resized: refuse, not guess
            if embedding:
                starts = {embedding: targets.get(embedding), **({head_name: head} if reason else {})}
            else:
                vocabulary = (model_config.input_embedding(shapes, config), head_name)
                starts = {name: targets.get(name) for name in vocabulary if name in shapes}
            for name, start in starts.items():
                saved = start.tensors.get("base") if start is not None else None
                if saved is None or saved.shape[0] != rows:
                    raise CheckpointError(
                        f"{adapter.path}: resizes the vocabulary to {rows} tokens but saves no {rows}-row '{name}'; "
                        "the trained model's new rows of it are not in the adapter"
                    )
        merged = {}
        for anchor, recipe in recipes.items():
            name, code, _ = recipe.output(dtype)
            target = targets.get(name)
            if target is not None and not DTYPES[code].cast:
                raise CheckpointError(f"{adapter.path}: changes '{name}', which is not a floating tensor")
            merged[anchor] = cls(recipe, target, adapter, keep_non_finite) if target is not None else recipe
            if reason and name == embedding:  # the head right after the tensor it starts from
                untied = Untied(recipe, head_name)
                merged[head_name] = cls(untied, head, adapter, keep_non_finite) if head else untied
        return merged, Merged(adapter, reason, (embedding, head_name) if embedding else None, rows)

    @property
    def sources(self) -> tuple:
        return (*self.base.sources, *self.target.tensors.values())

    def output(self, dtype: DType) -> tuple[str, str, tuple]:
        name, code, shape = self.base.output(dtype)
        saved = self.target.tensors.get("base")  # a saved replacement may have more rows (a resized vocabulary)
        return name, code, tuple(saved.shape) if saved is not None else shape

    def exceeds_fp16(self) -> bool:
        return True  # the adapter's change is added

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        """On the GPU route the weight is made whole and merged in device memory, and copied out a piece at a time
        through the route's pinned buffers: host memory holds a few pieces. On the CPU route, host memory holds the
        merged weight (and its fp32 delta while merging) for each shard written at once."""
        import torch

        if "base" in self.target.tensors:  # the adapter's saved weight replaces the base's (it may have more rows)
            base = torch.empty(0, dtype=DTYPES[tensor.dtype].torch, device=route.device)
        else:
            made = whole(dataclasses.replace(tensor, recipe=self.base), reader, route, route.device)
            base = made.view(DTYPES[tensor.dtype].torch).view(tensor.shape).to(route.device)
        before = peft_finite.non_finite(base)
        merged = peft_merge.merge(self.target, base, peft_merge.read_lora(self.target, reader), inplace=True)
        made = peft_finite.made(merged, before)
        if any(made):
            refused = peft_finite.refusal(self.adapter.path, tensor.name, *made, tensor.dtype)
            if not self.keep_non_finite:
                raise refused
            self.non_finite.append(f"{tensor.name} ({peft_finite.described(*made)})")
        yield from route.pieces_of(merged.contiguous().view(-1).view(torch.uint8), self.sources[0])


@dataclass(frozen=True)
class Merged:
    """What merging an adapter did beyond the tensors: the plan's record of it (``Plan.merged``)."""

    adapter: peft_lora.Adapter
    untied: str | None  # why the tied base's head is written apart from its input embeddings
    tied: tuple | None  # (input embeddings, head) of a tied base
    rows: int | None  # the vocabulary the adapter resized the model to
    files: list[Path] = field(default_factory=list)  # the adapter's tokenizer files the output holds, relative to it
