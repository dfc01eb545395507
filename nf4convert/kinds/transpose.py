"""A quantized weight of a transformers ``Conv1D`` layer (GPT-2 and its kin): transformers quantized it transposed,
(out, in), and the dense model holds it (in, out) (``model/conv1d.py`` says which layers). Made whole as quantized,
then written transposed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES, OUTPUT_DTYPES, DType
from ..model import conv1d
from ..pipeline.piece import Piece, pieces_from_memory
from .base import Planning, Recipe, register, whole


@register
@dataclass(frozen=True)
class Transpose(Recipe):
    """A Conv1D layer's quantized weight, stored (in, out) as the dense model holds it."""

    kind: ClassVar[str] = "transpose"
    label: ClassVar[str] = "dequantized and transposed (Conv1D)"
    order: ClassVar[int] = 50  # once the formats' weights are claimed
    base: Recipe

    @classmethod
    def plan_source(cls, planning: Planning) -> None:
        """Each claimed weight of a Conv1D layer, wrapped."""
        any_dtype = next(iter(OUTPUT_DTYPES.values()))  # a name does not depend on the dtype
        for anchor, recipe in planning.recipes.items():
            if recipe.format is not None and conv1d.is_conv1d_weight(recipe.output(any_dtype)[0], planning.config):
                planning.recipes[anchor] = cls(recipe)

    @property
    def sources(self) -> tuple:
        return self.base.sources

    @property
    def transposed(self) -> bool:
        return True

    def output(self, dtype: DType) -> tuple[str, str, tuple]:
        name, code, shape = self.base.output(dtype)
        return name, code, tuple(reversed(shape))

    def exceeds_fp16(self) -> bool:
        return self.base.exceeds_fp16()

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        """Memory: the weight twice, for each shard written at once."""
        import torch

        base = dataclasses.replace(tensor, recipe=self.base, shape=tuple(reversed(tensor.shape)))
        made = whole(base, reader, route).view(DTYPES[tensor.dtype].torch).view(base.shape)
        transposed = made.T.contiguous().view(-1).view(torch.uint8)
        yield from pieces_from_memory(transposed, self.sources[0], route.piece_bytes)
