"""A quantized weight of a transformers ``Conv1D`` layer (GPT-2 and its kin): transformers quantized it transposed,
(out, in), and the dense model holds it (in, out) (``formats/conv1d.py`` says which layers). Made whole as quantized,
then written transposed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES, DType
from ..formats import conv1d
from ..pipeline.piece import Piece, pieces_from_memory
from .base import Recipe, whole


@dataclass(frozen=True)
class Transpose(Recipe):
    """A Conv1D layer's quantized weight, stored (in, out) as the dense model holds it."""

    kind: ClassVar[str] = "transpose"
    label: ClassVar[str] = "dequantized and transposed (Conv1D)"
    base: Recipe

    @classmethod
    def wrap(cls, quantized: dict[str, Recipe], config: dict | None) -> dict[str, Recipe]:
        """``quantized`` (name -> recipe) with each Conv1D layer's weight wrapped."""
        return {
            name: cls(recipe) if conv1d.is_conv1d_weight(recipe.weight.name, config) else recipe
            for name, recipe in quantized.items()
        }

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
