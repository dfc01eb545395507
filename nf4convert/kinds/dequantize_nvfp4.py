"""An NVFP4 weight (``formats/nvfp4.py``; compressed-tensors ``nvfp4-pack-quantized``, ``formats/compressed_nvfp4.py``):
each E2M1 value times its group's E4M3 scale over the tensor's global scale in fp32, rounded once to the output
dtype, in pieces of whole rows: the same torch ops on the host and on a GPU, so both routes write the same bytes.
Its scales are read once per weight (an eighth of its codes' bytes), checked for NaN, and sliced per piece.

It also checks, once, a compressed-tensors config's groups for every format that reads them
(``compressed_nvfp4.check_groups``): it plans first among them."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES
from ..errors import CheckpointError
from ..formats import compressed_nvfp4, nvfp4
from ..formats.packed_int import host_array
from ..pipeline.piece import Piece
from .base import Planning, QuantizedWeight, register


@register
@dataclass(frozen=True)
class DequantizeNvfp4(QuantizedWeight):
    """An NVFP4 weight, dense in the output dtype."""

    kind: ClassVar[str] = "dequantize_nvfp4"
    label: ClassVar[str] = "dequantized from NVFP4"
    format: ClassVar[type[compressed_nvfp4.CompressedNvfp4Format]] = compressed_nvfp4.CompressedNvfp4Format
    order: ClassVar[int] = 29  # before the other compressed-tensors formats: the groups are checked first
    weight: nvfp4.WeightNvfp4

    @classmethod
    def plan_source(cls, planning: Planning) -> None:
        """A compressed-tensors config's groups checked; the layers of its NVFP4 groups (each checked), by their
        packed codes' name; their static activation scales dropped."""
        quantization = planning.quantization
        if not quantization or quantization.get("quant_method") != "compressed-tensors":
            return
        compressed_nvfp4.check_groups(quantization, planning.tensors)
        if not cls.format.reads_config(quantization):
            return
        problem = cls.format.config_problem(quantization)
        if problem is not None:
            raise CheckpointError(problem)
        found = compressed_nvfp4.find_weights(planning.tensors, planning.reader, quantization)
        planning.claim({weight.packed.name: cls(weight) for weight in found})
        planning.consumed.update(compressed_nvfp4.activation_keys(found, planning.tensors))

    @property
    def source_format(self) -> str:
        return f"{self.format.name} ({self.weight.group})"

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        """Pieces of whole rows, each with its rows' scales (numpy bytes on the host, moved to the GPU once where the
        route computes there) and the global scale."""
        import torch

        weight = self.weight
        rows, columns = weight.shape
        itemsize = DTYPES[tensor.dtype].itemsize
        if not tensor.nbytes:
            return
        scales = host_array(reader, weight.scale).reshape(rows, weight.groups)
        nvfp4.check_scales(weight.scale, scales)
        global_scale = float(reader.tensor(weight.global_scale).reshape(-1)[0])
        arguments = dict(global_scale=global_scale, multiply=weight.multiplies)
        if route.gpu:
            scales = torch.from_numpy(scales).to(route.device)
        step = max(1, route.piece_bytes // max(1, columns * itemsize))
        half = columns // 2
        for first in range(0, rows, step):
            count = min(step, rows - first)
            used = scales[first : first + count]
            if route.gpu:
                make = route.make(
                    None,
                    functools.partial(dequantize_on_device, scales=used, out_code=tensor.dtype, **arguments),
                )
            else:
                make = route.make(functools.partial(nvfp4.host, scales=used.copy(), out_code=tensor.dtype, **arguments))
            yield Piece(
                first * columns * itemsize,
                count * columns * itemsize,
                weight.packed,
                first * half,
                count * half,
                make,
                on_device=True,
            )


def dequantize_on_device(read, out, *, scales, global_scale: float, out_code: str, multiply: bool = False):
    """Whole rows of an NVFP4 weight (their packed bytes, a uint8 tensor on the GPU) dequantized with their scales
    (uint8, on the GPU). Returns the bytes made, a uint8 tensor on the GPU."""
    import torch

    packed = read.view(scales.shape[0], -1)
    scale = torch.tensor(global_scale, dtype=torch.float32, device=read.device)
    dense = nvfp4.dequantize(packed, scales, scale, DTYPES[out_code].torch, multiply=multiply)
    return dense.reshape(-1).view(torch.uint8)
