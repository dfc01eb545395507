"""A DeepSeek-V4 FP4 expert weight (``formats/deepseek_fp4.py``): each E2M1 value times its group's E8M0 scale in
fp32, rounded once to the output dtype, in pieces of whole rows: the same torch ops on the host and on a GPU, so both
routes write the same bytes. Its scales (a sixteenth of its codes' bytes) are read once per weight and sliced per
piece. It plans before the FP8 weights of the same checkpoint (``dequantize_fp8``), whose F8 weights it leaves."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES
from ..formats import deepseek_fp4
from ..formats.packed_int import host_array
from ..pipeline.piece import Piece
from .base import Planning, QuantizedWeight, register


@register
@dataclass(frozen=True)
class DequantizeDeepseekFp4(QuantizedWeight):
    """A DeepSeek-V4 FP4 expert weight, dense in the output dtype."""

    kind: ClassVar[str] = "dequantize_deepseek_fp4"
    label: ClassVar[str] = "dequantized from FP4"
    format: ClassVar[type[deepseek_fp4.DeepseekFp4Format]] = deepseek_fp4.DeepseekFp4Format
    order: ClassVar[int] = 27
    weight: deepseek_fp4.WeightFp4

    @classmethod
    def plan_source(cls, planning: Planning) -> None:
        """The FP4 experts (each checked) of a checkpoint whose config says ``fp8``, by their codes' name."""
        quantization = planning.quantization
        if not quantization or not cls.format.reads_config(quantization):
            return
        found = deepseek_fp4.find_weights(planning.tensors, planning.reader)
        planning.claim({weight.packed.name: cls(weight) for weight in found})

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        """Pieces of whole rows, each with its rows' scale bytes (numpy on the host, moved to the GPU once where the
        route computes there)."""
        import torch

        weight = self.weight
        rows, columns = weight.shape
        itemsize = DTYPES[tensor.dtype].itemsize
        if not tensor.nbytes:
            return
        scales = host_array(reader, weight.scale).view("uint8").reshape(rows, weight.groups)
        if route.gpu:
            scales = torch.from_numpy(scales).to(route.device)
        step = max(1, route.piece_bytes // max(1, columns * itemsize))
        half = columns // 2
        for first in range(0, rows, step):
            count = min(step, rows - first)
            used = scales[first : first + count]
            if route.gpu:
                make = route.make(None, functools.partial(dequantize_on_device, scales=used, out_code=tensor.dtype))
            else:
                make = route.make(functools.partial(deepseek_fp4.host, scales=used.copy(), out_code=tensor.dtype))
            yield Piece(
                first * columns * itemsize,
                count * columns * itemsize,
                weight.packed,
                first * half,
                count * half,
                make,
                on_device=True,
            )


def dequantize_on_device(read, out, *, scales, out_code: str):
    """Whole rows of an FP4 expert weight (their packed bytes, a uint8 tensor on the GPU) dequantized with their
    scale bytes (uint8, on the GPU). Returns the bytes made, a uint8 tensor on the GPU."""
    import torch

    packed = read.view(scales.shape[0], -1)
    dense = deepseek_fp4.dequantize(packed, scales, DTYPES[out_code].torch)
    return dense.reshape(-1).view(torch.uint8)
