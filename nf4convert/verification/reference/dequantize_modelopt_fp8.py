"""The reference of a ModelOpt FP8 weight: ModelOpt's own ``FP8QTensor.dequantize`` where nvidia-modelopt imports,
else its arithmetic restated from nvidia-modelopt 0.47.0 (``modelopt/torch/quantization/qtensor/fp8_tensor.py``: one
scale per tensor, no ``block_sizes``: ``quantized_data.to(dtype) * scale.to(dtype)``; ``tests/test_modelopt.py``
checks it against the library where it is installed), in runs of whole rows (each element depends on its code and
the one scale alone)."""

from __future__ import annotations

from ...dtypes import DTYPES
from . import modelopt
from .base import Slice, as_bytes, whole


def library():
    """ModelOpt's ``FP8QTensor`` where nvidia-modelopt imports, else None."""
    return modelopt.qtensor("fp8_tensor", "FP8QTensor")


def against(tensor, device) -> str:
    return modelopt.against("FP8QTensor", library())


def slices(tensor, reader, device, context, piece_bytes: int):
    weight = tensor.recipe.weight
    scale = reader.tensor(weight.scale).to(device)
    columns = weight.shape[-1]
    rows = weight.grid.rows
    row_bytes = max(1, columns * DTYPES[tensor.dtype].itemsize)
    step = max(1, piece_bytes // row_bytes)
    for first in range(0, rows, step):
        count = min(step, rows - first)
        yield Slice(first * row_bytes, count * row_bytes, _rows(tensor.dtype, weight, scale, first, count, device))


def _rows(code, weight, scale, first, count, device):
    def make(read, take):
        import torch

        dtype = DTYPES[code].torch
        columns = weight.shape[-1]
        codes = read(weight.weight, first * columns, count * columns)
        codes = codes.view(DTYPES[weight.weight.dtype].torch).reshape(count, columns).to(device)
        found = library()
        if found is not None:
            return as_bytes(found(torch.Size([count, columns]), dtype, codes).dequantize(dtype=dtype, scale=scale))
        return as_bytes(codes.to(dtype) * scale.to(dtype))

    return make


def reference(tensor, reader, device, context):
    return whole(tensor, reader, device, context)
