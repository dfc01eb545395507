"""A bitsandbytes 4-bit (NF4/FP4) weight, dequantized with bitsandbytes' CUDA arithmetic (``formats/bnb4_weights.py``
finds and checks it, ``formats/bnb4.py`` owns its quant state), in pieces of whole quant blocks: on the host by the
exact numpy path (``kernels/cpu.py``), on a GPU by the Triton kernel (``dequantize.py``), bit for bit the same."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES
from ..formats import bnb4, bnb4_weights
from ..pipeline.piece import Piece
from .base import Planning, QuantizedWeight, register


@register
@dataclass(frozen=True)
class Dequantize4bit(QuantizedWeight):
    """A bitsandbytes 4-bit weight, dequantized (bitsandbytes' CUDA arithmetic) to the output dtype."""

    kind: ClassVar[str] = "dequantize_4bit"
    label: ClassVar[str] = "dequantized from 4-bit"
    format: ClassVar[type[bnb4_weights.Bnb4bit]] = bnb4_weights.Bnb4bit
    order: ClassVar[int] = 10
    numpy_made: ClassVar[bool] = True
    uses_kernel: ClassVar[bool] = True
    weight: bnb4_weights.Weight4bit

    @classmethod
    def plan_source(cls, planning: Planning) -> None:
        """The checkpoint's 4-bit weights (each checked), by the packed tensor's name; then a tensor that looks like a
        packed weight but has no quant state is refused."""
        found = bnb4_weights.find_weights(planning.tensors, planning.reader)
        planning.claim({weight.packed.name: cls(weight) for weight in found})
        bnb4_weights.unclaimed_packed(planning.tensors, found, planning.quantization)

    def exceeds_fp16(self) -> bool:
        # A double-quantized block's rebuilt scale (nested code * nested absmax + offset) can exceed its own absmax:
        # an fp16 weight at 65504 can come back as inf, from bitsandbytes too.
        return self.weight.meta.get("dtype") != "float16" or self.weight.nested

    @property
    def quantized_from(self) -> str | None:
        return self.weight.meta["dtype"]

    @property
    def source_format(self) -> str:
        return f"{self.format.name} {self.weight.quant_type}"

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        """Pieces of whole (nested) quant blocks, each with its own slice of the quant state: read as numpy arrays,
        moved to the GPU once where the route computes there."""
        weight = self.weight
        out_type = DTYPES[tensor.dtype]
        state = bnb4_weights.load_state(weight, reader, dtype=tensor.dtype)
        if route.gpu:
            state = bnb4.on_device(state, route.device)
        for first, count, piece in bnb4.chunks(state, route.piece_bytes // out_type.itemsize):
            if route.gpu:
                make = route.make(None, functools.partial(dequantize_on_device, state=piece))
            else:
                make = route.make(functools.partial(dequantize_on_host, state=piece))
            yield Piece(
                first * out_type.itemsize,
                count * out_type.itemsize,
                weight.packed,
                first // 2,
                (count + 1) // 2,
                make,
                on_device=True,
            )


def dequantize_on_host(packed, out, *, state: bnb4.QuantState4bit) -> None:
    """A piece's packed bytes (numpy uint8) dequantized into ``out`` (numpy uint8) with its quant state as read
    (numpy arrays, the output dtype's safetensors name): the exact CPU path."""
    from ..kernels import cpu

    nested = state.state2
    cpu.dequantize(
        packed,
        state.absmax,
        nested and nested.code,
        nested and nested.absmax,
        state.offset,
        bnb4.CODES[state.quant_type],
        out,
        state.dtype,
        state.blocksize,
        nested.blocksize if nested else 0,
    )


def dequantize_on_device(packed, out, *, state: bnb4.QuantState4bit):
    """A piece's packed bytes (a uint8 tensor on the GPU) dequantized into ``out`` (uint8, on the GPU) with its quant
    state on that GPU: the Triton kernel. Returns ``out``."""
    from ..dequantize import dequantize_4bit

    dequantize_4bit(packed, state, out=out.view(state.dtype))
    return out
