"""The reference of a ModelOpt NVFP4 weight: ModelOpt's own ``NVFP4QTensor.dequantize`` (its non-fast path) where
nvidia-modelopt imports, else its arithmetic restated statement by statement from the pinned source, in runs of
whole rows.

nvidia-modelopt is not a dependency (it pulls in omegaconf, pulp, nvidia-ml-py and ninja, and warns on every
transformers it was not tested with), so this module restates, from nvidia-modelopt 0.47.0
``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``: the module-level ``e2m1_values`` table (fp32, +0.0 at nibble
8), ``_unpack_tensor`` (high nibble to the odd columns, low to the even ones, into a tensor of the output dtype, then
``.long()`` and the table lookup), ``per_block_scale = weight_scale.to(float32) * weight_scale_2`` and
``(values.view(..., -1, block_size) * per_block_scale.unsqueeze(-1)).reshape(shape).to(dtype)``.
``tests/test_modelopt.py`` checks the restatement against the library where it is installed. Each row depends on its
own codes and scales and the tensor's ``weight_scale_2`` alone.
"""

from __future__ import annotations

from ...dtypes import DTYPES
from . import modelopt
from .base import Slice, as_bytes, unpacking_rows, whole

BLOCK = 16
# nvfp4_tensor.py's e2m1_values (nibble 8 is +0.0 there)
E2M1_VALUES = (0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6)


def library():
    """ModelOpt's ``NVFP4QTensor`` where nvidia-modelopt imports, else None."""
    return modelopt.qtensor("nvfp4_tensor", "NVFP4QTensor")


def against(tensor, device) -> str:
    return modelopt.against("NVFP4QTensor", library())


def slices(tensor, reader, device, context, piece_bytes: int):
    weight = tensor.recipe.weight
    packed = reader.tensor(weight.packed).to(device)
    scale = reader.tensor(weight.scale).to(device)
    scale_2 = reader.tensor(weight.global_scale).to(device)
    rows, columns = packed.shape[0], packed.shape[1] * 2
    row_bytes = columns * DTYPES[tensor.dtype].itemsize
    step = unpacking_rows(piece_bytes, row_bytes, 1, device)
    for first in range(0, rows, step):
        count = min(step, rows - first)
        make = _rows(tensor.dtype, packed[first : first + count], scale[first : first + count], scale_2)
        yield Slice(first * row_bytes, count * row_bytes, make)


def _rows(code, packed, scale, scale_2):
    def make(read, take):
        import torch

        dtype = DTYPES[code].torch
        shape = torch.Size([packed.shape[0], packed.shape[1] * 2])
        found = library()
        if found is not None:
            quantized = found(shape, dtype, packed)
            dense = quantized.dequantize(dtype=dtype, scale=scale, double_scale=scale_2, block_sizes={-1: BLOCK})
            return as_bytes(dense)
        return as_bytes(restated(packed, scale, scale_2, dtype))

    return make


def restated(packed, scale, scale_2, dtype):
    """``NVFP4QTensor(shape, dtype, packed).dequantize(dtype, scale=scale, double_scale=scale_2, block_sizes={-1:
    16})``, restated (0.47.0)."""
    import torch

    values_table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    shape = [packed.shape[0], packed.shape[1] * 2]
    unpacked = torch.empty(shape, dtype=dtype, device=packed.device)
    unpacked[..., 1::2] = packed >> 4
    unpacked[..., 0::2] = packed & 0x0F
    values = values_table[unpacked.reshape(-1).long()].reshape(shape)
    per_block_scale = (scale.to(torch.float32) if scale.dtype == torch.float8_e4m3fn else scale) * scale_2
    dense = values.view(shape[0], -1, BLOCK) * per_block_scale.unsqueeze(-1)
    return dense.reshape(shape).to(dtype)


def reference(tensor, reader, device, context):
    return whole(tensor, reader, device, context)
