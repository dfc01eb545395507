"""The reference of a DeepSeek-V4 FP4 expert weight: transformers' ``Fp8Dequantize._dequantize_one``
(``integrations/finegrained_fp8.py``: ``_unpack_fp4`` of the int8 codes, the block taken from the scale grid, one
per 32 values of a row, ``(q * s).to(dtype)`` with the E8M0 scale in fp32), what ``FineGrainedFP8Config(
dequantize=True)`` runs for these experts, in the output dtype, in runs of whole rows (each row depends on its own
codes and scales alone)."""

from __future__ import annotations

from ...dtypes import DTYPES
from .base import Library, Slice, as_bytes, unpacking_rows, whole

TRANSFORMERS = Library("transformers", "FP4 experts (transformers' finegrained_fp8 dequantization)", "transformers")


def against(tensor, device) -> str:
    return "transformers (Fp8Dequantize)"


def libraries(recipe) -> tuple[Library, ...]:
    return (TRANSFORMERS,)


def slices(tensor, reader, device, context, piece_bytes: int):
    import torch

    weight = tensor.recipe.weight
    packed = reader.tensor(weight.packed).to(device)
    scale = reader.tensor(weight.scale)
    if scale.dtype == torch.uint8:  # E8M0 bytes, as transformers views U8 scales under ue8m0
        scale = scale.view(torch.float8_e8m0fnu)
    scale = scale.to(device)
    rows, columns = packed.shape[0], packed.shape[1] * 2
    row_bytes = columns * DTYPES[tensor.dtype].itemsize
    step = unpacking_rows(piece_bytes, row_bytes, 1, device)
    for first in range(0, rows, step):
        count = min(step, rows - first)
        make = _rows(tensor.dtype, packed[first : first + count], scale[first : first + count])
        yield Slice(first * row_bytes, count * row_bytes, make)


def _rows(code, packed, scale):
    def make(read, take):
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize

        dense = Fp8Dequantize(None)._dequantize_one(packed, scale, output_dtype=DTYPES[code].torch)
        return as_bytes(dense)

    return make


def reference(tensor, reader, device, context):
    return whole(tensor, reader, device, context)
