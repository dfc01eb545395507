"""The reference of an MXFP4 expert weight (gpt-oss): transformers' ``convert_moe_packed_tensors``
(``integrations/mxfp4.py``, what ``Mxfp4Config(dequantize=True)`` runs) in the output dtype, in runs of whole
experts (each expert's blocks and scales stand alone; the function transposes each expert's [R, G * 32] rows into
the [G * 32, R] weight ``GptOssExperts`` holds)."""

from __future__ import annotations

from ...dtypes import DTYPES
from .base import Slice, as_bytes, whole


def against(tensor, device) -> str:
    return "transformers"


def libraries(recipe) -> tuple[str, ...]:
    return ("transformers",)


def slices(tensor, reader, device, context, piece_bytes: int):
    weight = tensor.recipe.weight
    experts, dense_rows, rows = tensor.shape
    expert_bytes = max(1, dense_rows * rows * DTYPES[tensor.dtype].itemsize)
    step = max(1, piece_bytes // expert_bytes)
    for first in range(0, experts, step):
        count = min(step, experts - first)
        yield Slice(first * expert_bytes, count * expert_bytes, _experts(weight, tensor.dtype, first, count, device))


def _experts(weight, dtype: str, first: int, count: int, device):
    def make(read, take):
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        _, rows, groups, width = weight.blocks.shape
        blocks = read(weight.blocks, first * rows * groups * width, count * rows * groups * width)
        scales = read(weight.scales, first * rows * groups, count * rows * groups)
        blocks = blocks.reshape(count, rows, groups, width).to(device)
        scales = scales.reshape(count, rows, groups).to(device)
        return as_bytes(convert_moe_packed_tensors(blocks, scales, dtype=DTYPES[dtype].torch))

    return make


def reference(tensor, reader, device, context):
    return whole(tensor, reader, device, context)
