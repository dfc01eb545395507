"""Another recipe's tensor with a peft LoRA adapter's change merged in, bit for bit as peft merges it
(``formats/peft_lora.py`` reads the adapter and reproduces peft's arithmetic). A merge needs the whole base tensor:
it is made whole on the route's device, merged there, and written from memory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterator

from ..dtypes import DTYPES, DType
from ..errors import CheckpointError
from ..formats import config as model_config
from ..formats import peft_lora
from ..pipeline.piece import Piece, pieces_from_memory, whole
from .base import Recipe


@dataclass(frozen=True)
class MergeLora(Recipe):
    """Another recipe's tensor with a peft LoRA adapter's change merged in, bit for bit as peft merges it."""

    kind: ClassVar[str] = "merge_lora"
    label: ClassVar[str] = "merged with the adapter"
    base: Recipe
    target: peft_lora.LoraTarget
    adapter: peft_lora.Adapter = field(compare=False, repr=False)  # the whole adapter (verify rebuilds its module)

    @classmethod
    def wrap(
        cls, recipes: list[Recipe], adapter_folder: Path, dtype: DType, config: dict | None
    ) -> tuple[list[Recipe], peft_lora.Adapter]:
        """Each recipe whose tensor the adapter changes, wrapped in a merge; the adapter is checked first."""
        adapter = peft_lora.load_adapter(adapter_folder)
        shapes = {name: shape for name, _, shape in (recipe.output(dtype) for recipe in recipes)}
        config = config if isinstance(config, dict) else {}
        peft_lora.validate(adapter, shapes, config=config)
        tied = model_config.tied(config)
        if tied and any(name.endswith("lm_head.weight") for name in adapter.targets):
            # peft unties the head to merge it; transformers would tie it again on load and drop the change
            raise CheckpointError(
                f"{adapter.path}: changes lm_head, which the base ties to its input embeddings "
                "(tie_word_embeddings): not mergeable into a checkpoint that stays tied"
            )
        if tied:
            # modules_to_save replacing the input embeddings: peft swaps in the saved copy, the head keeps the old one,
            # and merge_and_unload unties them; a checkpoint that stays tied would give the head the new one
            vocab = model_config.vocab_size(config)
            for name, target in adapter.targets.items():
                shape = shapes.get(name, ())
                if target.kind != "replace" or len(shape) != 2:
                    continue
                if (
                    shape[0] == vocab
                    if vocab
                    else name.endswith(("embed_tokens.weight", "wte.weight", "word_embeddings.weight"))
                ):
                    raise CheckpointError(
                        f"{adapter.path}: modules_to_save replaces '{name}', the input embeddings, which "
                        "the base ties to lm_head (tie_word_embeddings): peft unties them on merge and "
                        "keeps the old head; not mergeable into a checkpoint that stays tied"
                    )
        merged = []
        for recipe in recipes:
            name, code, _ = recipe.output(dtype)
            target = adapter.targets.get(name)
            if target is not None and not DTYPES[code].cast:
                raise CheckpointError(f"{adapter.path}: changes '{name}', which is not a floating tensor")
            merged.append(cls(recipe, target, adapter) if target is not None else recipe)
        return merged, adapter

    @property
    def sources(self) -> tuple:
        return (*self.base.sources, *self.target.tensors.values())

    def output(self, dtype: DType) -> tuple[str, str, tuple]:
        return self.base.output(dtype)

    def exceeds_fp16(self) -> bool:
        return True  # the adapter's change is added

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        """On the GPU route the weight is made whole in device memory and the merged result copied out through
        pinned memory (a round trip through pageable pages costs many times the merge itself). Host memory: the
        merged weight (and on the CPU route about two fp32 copies while merging) for each shard written at once."""
        import torch

        made = whole(dataclasses.replace(tensor, recipe=self.base), reader, route, route.device)
        base = made.view(DTYPES[tensor.dtype].torch).view(tensor.shape).to(route.device)
        merged = peft_lora.merge(self.target, base, peft_lora.read_lora(self.target, reader), inplace=True)
        merged = merged.contiguous().view(-1).view(torch.uint8)
        if merged.is_cuda:  # out through pinned memory: several times faster than into fresh pageable pages
            merged = torch.empty(merged.numel(), dtype=torch.uint8, pin_memory=True).copy_(merged)
        yield from pieces_from_memory(merged, self.sources[0], route.piece_bytes)
