"""The reference of an MXFP4 expert weight (gpt-oss): transformers' ``convert_moe_packed_tensors``
(``integrations/mxfp4.py``, what ``Mxfp4Config(dequantize=True)`` runs) in the output dtype, in runs of whole
experts, or, where one expert is more than a slice, of whole 32-row groups of one expert (each expert's blocks and
scales stand alone, and so does each block: the function transposes an expert's [R, G * 32] rows into the [G * 32, R]
weight ``GptOssExperts`` holds, so the groups ``[g, g + n)`` of its blocks give dense rows ``[32 g, 32 (g + n))``).
"""

from __future__ import annotations

from ...dtypes import DTYPES
from .base import Library, Slice, as_bytes, whole


def against(tensor, device) -> str:
    return "transformers"


TRANSFORMERS = Library("transformers", "MXFP4 weights (transformers' convert_moe_packed_tensors)", "transformers")


def libraries(recipe) -> tuple[Library, ...]:
    return (TRANSFORMERS,)


def slices(tensor, reader, device, context, piece_bytes: int):
    weight = tensor.recipe.weight
    experts, dense_rows, rows = tensor.shape
    itemsize = DTYPES[tensor.dtype].itemsize
    expert_bytes = max(1, dense_rows * rows * itemsize)
    groups = dense_rows // 32
    if expert_bytes <= piece_bytes or groups == 0:
        step = max(1, piece_bytes // expert_bytes)
        for first in range(0, experts, step):
            count = min(step, experts - first)
            make = _groups(weight, tensor.dtype, first, count, 0, groups, device)
            yield Slice(first * expert_bytes, count * expert_bytes, make)
        return
    group_bytes = 32 * rows * itemsize
    step = max(1, piece_bytes // group_bytes)
    for expert in range(experts):
        for first in range(0, groups, step):
            count = min(step, groups - first)
            make = _groups(weight, tensor.dtype, expert, 1, first, count, device)
            yield Slice(expert * expert_bytes + first * group_bytes, count * group_bytes, make)


def _groups(weight, dtype: str, first: int, count: int, first_group: int, groups: int, device):
    def make(read, take):
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        _, rows, total, width = weight.blocks.shape
        blocks = read(weight.blocks, first * rows * total * width, count * rows * total * width)
        scales = read(weight.scales, first * rows * total, count * rows * total)
        blocks = blocks.reshape(count, rows, total, width)[:, :, first_group : first_group + groups].to(device)
        scales = scales.reshape(count, rows, total)[:, :, first_group : first_group + groups].to(device)
        return as_bytes(convert_moe_packed_tensors(blocks, scales, dtype=DTYPES[dtype].torch))

    return make


def reference(tensor, reader, device, context):
    return whole(tensor, reader, device, context)
