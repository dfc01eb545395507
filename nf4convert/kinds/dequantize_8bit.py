"""A bitsandbytes 8-bit (LLM.int8) weight: int8 codes times their row's scale over 127 (``formats/bnb8.py``), in
pieces of whole rows (each row has its own scale): the same torch arithmetic on the host and on a GPU."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES
from ..formats import bnb8
from ..pipeline.piece import Piece
from .base import Planning, QuantizedWeight, register


@register
@dataclass(frozen=True)
class Dequantize8bit(QuantizedWeight):
    """A bitsandbytes 8-bit (LLM.int8) weight: int8 codes times their row's scale over 127, in the output dtype."""

    kind: ClassVar[str] = "dequantize_8bit"
    label: ClassVar[str] = "dequantized from 8-bit"
    format: ClassVar[type[bnb8.Bnb8bit]] = bnb8.Bnb8bit
    order: ClassVar[int] = 20
    weight: bnb8.Weight8bit

    @classmethod
    def plan_source(cls, planning: Planning) -> None:
        """The checkpoint's 8-bit weights (each checked), by the int8 tensor's name; then an int8 weight whose scales
        were lost is refused."""
        found = bnb8.find_weights(planning.tensors, planning.reader)
        planning.claim({weight.weight.name: cls(weight) for weight in found})
        bnb8.unclaimed_int8(planning.tensors, found, planning.quantization)

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        """Pieces of whole rows, each with its rows' scales: a numpy array on the host, a tensor moved to the GPU once
        where the route computes there."""
        weight = self.weight
        rows, columns = weight.shape
        out_type = DTYPES[tensor.dtype]
        scb = reader.tensor(weight.scb)
        if route.gpu:
            scb = scb.to(route.device)
        step = max(1, route.piece_bytes // max(columns * out_type.itemsize, 1))  # whole rows
        for first in range(0, rows, step):
            count = min(step, rows - first)
            scales = scb[first : first + count]
            if route.gpu:
                compute = functools.partial(dequantize_on_device, scb=scales, columns=columns, dtype=tensor.dtype)
                make = route.make(None, compute)
            else:
                compute = functools.partial(dequantize_on_host, scb=scales.numpy(), columns=columns, dtype=tensor.dtype)
                make = route.make(compute)
            yield Piece(
                first * columns * out_type.itemsize,
                count * columns * out_type.itemsize,
                weight.weight,
                first * columns,
                count * columns,
                make,
                on_device=True,
            )


def dequantize_on_host(codes, out, *, scb, columns: int, dtype: str) -> None:
    """Whole rows of ``columns`` int8 codes (bytes, numpy uint8) dequantized into ``out`` (numpy uint8) as ``dtype``
    (safetensors' name), with their rows' scales ``scb`` (fp32, numpy)."""
    import torch

    rows, out_type = codes.size // columns, DTYPES[dtype].torch
    made = bnb8.dequantize(
        torch.from_numpy(codes).view(torch.int8).view(rows, columns), torch.from_numpy(scb), out_type
    )
    torch.from_numpy(out).view(out_type).view(rows, columns).copy_(made)


def dequantize_on_device(codes, out, *, scb, columns: int, dtype: str):
    """Whole rows of ``columns`` int8 codes (a uint8 tensor on the GPU) dequantized as ``dtype`` with their rows'
    scales ``scb`` (fp32, on the GPU). Returns the bytes made, a uint8 tensor on the GPU (not ``out``)."""
    import torch

    rows = codes.numel() // columns
    made = bnb8.dequantize(codes.view(torch.int8).view(rows, columns), scb, DTYPES[dtype].torch)
    return made.view(-1).view(torch.uint8)
