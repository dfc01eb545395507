"""An MXFP4 expert weight (gpt-oss, ``formats/mxfp4.py``): each FP4 value times its block's power of two, laid out
as transformers' dense ``GptOssExperts`` holds it ([experts, G * 32, R], the transpose of the blocks' rows), in
pieces of whole experts, or of whole 32-row groups of one expert. A piece reads its experts' blocks whole (the
transpose takes every block row of each dense row) and the scales it uses, which are checked as they are read (the
scales are a sixteenth of the blocks: more than a plan should read). The same torch ops on the host and on a GPU."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES
from ..formats import mxfp4
from ..pipeline.piece import Piece
from .base import Planning, QuantizedWeight, register


@register
@dataclass(frozen=True)
class DequantizeMxfp4(QuantizedWeight):
    """An MXFP4 expert weight, dense in the output dtype and in the dense model's orientation."""

    kind: ClassVar[str] = "dequantize_mxfp4"
    label: ClassVar[str] = "dequantized from MXFP4"
    format: ClassVar[type[mxfp4.Mxfp4Format]] = mxfp4.Mxfp4Format
    order: ClassVar[int] = 40
    weight: mxfp4.WeightMxfp4

    @classmethod
    def plan_source(cls, planning: Planning) -> None:
        """The checkpoint's MXFP4 weights (their headers checked), by the blocks' name."""
        planning.claim({weight.blocks.name: cls(weight) for weight in mxfp4.find_weights(planning.tensors)})

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        """Pieces of whole experts or of whole groups of one expert, each with its scales (read once per run of
        experts, checked, and moved to the GPU where the route computes there)."""
        weight = self.weight
        itemsize = DTYPES[tensor.dtype].itemsize
        per_expert = weight.rows * weight.groups
        held = None  # (first expert, experts, their scales) last read
        for piece in weight.pieces(route.piece_bytes // itemsize):
            first_expert, experts, first_group, groups = piece
            if held is None or held[:2] != (first_expert, experts):
                scales = reader.read(weight.scales, first_expert * per_expert, experts * per_expert)
                mxfp4.check_scales(weight.scales, scales)
                scales = scales.reshape(experts, weight.rows, weight.groups)
                held = (first_expert, experts, scales.to(route.device) if route.gpu else scales.numpy())
            used = held[2][:, :, first_group : first_group + groups]
            arguments = dict(rows=weight.rows, total_groups=weight.groups, first_group=first_group)
            arguments["out_code"], arguments["name"] = tensor.dtype, tensor.name
            if route.gpu:
                make = route.make(None, functools.partial(dequantize_on_device, scales=used, **arguments))
            else:
                make = route.make(functools.partial(dequantize_on_host, scales=used.copy(), **arguments))
            offset, nbytes = mxfp4.output_bytes(weight, piece, itemsize)
            first, count = mxfp4.source_bytes(weight, piece)
            yield Piece(offset, nbytes, weight.blocks, first, count, make, on_device=True)


def _blocks(read, rows: int, total_groups: int, first_group: int, groups: int):
    """The blocks of a piece's groups: a view of its experts' blocks (as read) [experts, R, groups, 16]."""
    experts = read.shape[0] // max(1, rows * total_groups * mxfp4.BLOCK_BYTES)
    whole = read.view(experts, rows, total_groups, mxfp4.BLOCK_BYTES)
    return whole[:, :, first_group : first_group + groups]


def dequantize_on_host(
    read, out, *, scales, rows: int, total_groups: int, first_group: int, out_code: str, name: str = ""
) -> None:
    """A piece: ``read`` the blocks of whole experts (numpy uint8), ``scales`` those of its groups [experts, R,
    groups] (numpy uint8), ``out`` the dense bytes of those groups, written in place."""
    import torch

    groups = scales.shape[2]
    blocks = _blocks(torch.from_numpy(read), rows, total_groups, first_group, groups)
    mxfp4.check_range(blocks, torch.from_numpy(scales), name)
    dense = mxfp4.dequantize(blocks, torch.from_numpy(scales), DTYPES[out_code].torch)
    torch.from_numpy(out).copy_(dense.reshape(-1).view(torch.uint8))


def dequantize_on_device(
    read, out, *, scales, rows: int, total_groups: int, first_group: int, out_code: str, name: str = ""
):
    """A piece on the GPU: ``read`` its experts' blocks, ``scales`` its groups' (both uint8 on the GPU). Returns the
    dense bytes, a uint8 tensor on the GPU."""
    import torch

    groups = scales.shape[2]
    blocks = _blocks(read, rows, total_groups, first_group, groups)
    mxfp4.check_range(blocks, scales, name)
    return mxfp4.dequantize(blocks, scales, DTYPES[out_code].torch).reshape(-1).view(torch.uint8)
