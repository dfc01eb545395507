"""A bitsandbytes 4-bit (NF4/FP4) weight, dequantized with bitsandbytes' CUDA arithmetic (``formats/bnb4.py`` reads
and checks it; the route's kernel makes it), in pieces of whole quant blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES, DType
from ..formats import bnb4, bnb4_weights
from ..pipeline.piece import Piece
from .base import Recipe


@dataclass(frozen=True)
class Dequantize4bit(Recipe):
    """A bitsandbytes 4-bit weight, dequantized (bitsandbytes' CUDA arithmetic) to the output dtype."""

    kind: ClassVar[str] = "dequantize_4bit"
    label: ClassVar[str] = "dequantized from 4-bit"
    numpy_made: ClassVar[bool] = True
    uses_kernel: ClassVar[bool] = True
    is_quantized: ClassVar[bool] = True
    weight: bnb4_weights.Weight4bit

    @classmethod
    def claim(cls, tensors: dict, reader) -> dict[str, "Dequantize4bit"]:
        """The checkpoint's 4-bit weights (each checked), by the packed tensor's name."""
        return {weight.packed.name: cls(weight) for weight in bnb4_weights.find_weights(tensors, reader)}

    @property
    def sources(self) -> tuple:
        return self.weight.sources

    def output(self, dtype: DType) -> tuple[str, str, tuple]:
        return self.weight.name, dtype.code, self.weight.shape

    def exceeds_fp16(self) -> bool:
        # A double-quantized block's rebuilt scale (nested code * nested absmax + offset) can exceed its own absmax:
        # an fp16 weight at 65504 can come back as inf, from bitsandbytes too.
        return self.weight.meta.get("dtype") != "float16" or self.weight.nested

    @property
    def quantized_from(self) -> str | None:
        return self.weight.meta["dtype"]

    @property
    def source_format(self) -> str:
        return f"bnb-4bit {self.weight.quant_type}"

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        weight = self.weight
        out_type = DTYPES[tensor.dtype]
        state = route.state_4bit(bnb4_weights.load_state(weight, reader, dtype=tensor.dtype))
        for first, count, piece in bnb4.chunks(state, route.piece_bytes // out_type.itemsize):
            yield Piece(
                first * out_type.itemsize,
                count * out_type.itemsize,
                weight.packed,
                first // 2,
                (count + 1) // 2,
                route.dequantize_4bit(piece),
                on_device=True,
            )
