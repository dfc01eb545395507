"""A tied base's input embeddings written again under the head's name. Where an adapter makes the head of a tied
base differ from its input embeddings (``adapters/lora.py``: untie_reason), the output holds the head apart:
this is its starting tensor, the embeddings' bytes made the same way, and a merge wraps it with the head's change."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DType
from ..pipeline.piece import Piece
from .base import Recipe, register


@register
@dataclass(frozen=True)
class Untied(Recipe):
    """The input embeddings' tensor, as the untied head's (made by a merge's planning, ``merge_lora.py``)."""

    kind: ClassVar[str] = "untied"
    label: ClassVar[str] = "the input embeddings, as the untied head"
    base: Recipe
    name: str  # the head's tensor, e.g. lm_head.weight

    @property
    def sources(self) -> tuple:
        return self.base.sources

    def output(self, dtype: DType) -> tuple[str, str, tuple]:
        return (self.name, *self.base.output(dtype)[1:])

    def exceeds_fp16(self) -> bool:
        return self.base.exceeds_fp16()

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        yield from self.base.produce(dataclasses.replace(tensor, recipe=self.base), reader, route)
