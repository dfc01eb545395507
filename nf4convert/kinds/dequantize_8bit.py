"""A bitsandbytes 8-bit (LLM.int8) weight: int8 codes times their row's scale over 127 (``formats/bnb8.py``), in
pieces of whole rows (each row has its own scale)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES, DType
from ..formats import bnb8
from ..pipeline.piece import Piece
from .base import Recipe


@dataclass(frozen=True)
class Dequantize8bit(Recipe):
    """A bitsandbytes 8-bit (LLM.int8) weight: int8 codes times their row's scale over 127, in the output dtype."""

    kind: ClassVar[str] = "dequantize_8bit"
    label: ClassVar[str] = "dequantized from 8-bit"
    is_quantized: ClassVar[bool] = True
    weight: bnb8.Weight8bit

    @classmethod
    def claim(cls, tensors: dict, reader) -> dict[str, "Dequantize8bit"]:
        """The checkpoint's 8-bit weights (each checked), by the int8 tensor's name."""
        return {weight.weight.name: cls(weight) for weight in bnb8.find_weights(tensors, reader)}

    @property
    def sources(self) -> tuple:
        return self.weight.sources

    def output(self, dtype: DType) -> tuple[str, str, tuple]:
        return self.weight.name, dtype.code, self.weight.shape

    def exceeds_fp16(self) -> bool:
        return True  # fp32 row scales

    @property
    def source_format(self) -> str:
        return "bnb-8bit"

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        weight = self.weight
        rows, columns = weight.shape
        out_type = DTYPES[tensor.dtype]
        scb = reader.tensor(weight.scb).to(route.device)
        step = max(1, route.piece_bytes // max(columns * out_type.itemsize, 1))  # whole rows
        for first in range(0, rows, step):
            count = min(step, rows - first)
            yield Piece(
                first * columns * out_type.itemsize,
                count * columns * out_type.itemsize,
                weight.weight,
                first * columns,
                count * columns,
                route.dequantize_8bit(scb[first : first + count], columns, out_type.torch),
                on_device=True,
            )
