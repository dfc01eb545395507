"""The reference of an FP8 weight, computed by the reference libraries only, in runs of whole rows of scales.

- ``fp8`` checkpoints with block scales (DeepSeek V3/R1, Qwen3-*-FP8): compressed-tensors' ``FP8BlockDequantizer``
  (``entrypoints/convert/converters/fp8block_dequantizer.py``, 0.20): the weight padded to whole blocks,
  ``(weight.to(fp32) * weight_scale_inv.to(fp32)).to(dtype)``, the padding cut off; the same values as DeepSeek's
  own ``weight_dequant`` Triton kernel (``inference/kernel.py``), which masks the partial edge tiles. transformers'
  ``Fp8Dequantize`` is not the reference here: it derives the block from the scale grid and so refuses, or
  mis-blocks, a weight whose shape is not whole blocks.
- ``fp8`` checkpoints with one scale per tensor: transformers' ``Fp8Dequantize._dequantize_one`` (what
  ``FineGrainedFP8Config(dequantize=True)`` runs), in the output dtype as transformers loads a model of that dtype.
- compressed-tensors FP8 (tensor, channel, block strategies; the kind ``dequantize_compressed_fp8``, whose reference
  module takes this one's): the library's ``FloatQuantizationCompressor.decompress`` on the checkpoint's tensors as
  stored, which multiplies in the scale's dtype (what ``CompressedTensorsConfig(dequantize=True)`` runs), then the
  cast to the output dtype.

``scale_fmt: "ue8m0"`` scales stored as E8M0 bytes are handed over as torch's fp32 value of each byte (what
transformers' ``FineGrainedFP8Config(scale_fmt="ue8m0")`` loads them as); power-of-two float scales as they are.

Each element depends on its own code and its block's scale alone, so a run of rows computes as in the whole weight.
"""

from __future__ import annotations

from ...dtypes import DTYPES
from .base import Library, Slice, as_bytes, whole


def against(tensor, device) -> str:
    weight = tensor.recipe.weight
    if weight.format == "compressed-tensors":
        return "compressed-tensors"
    return "compressed-tensors (FP8BlockDequantizer)" if weight.strategy == "block" else "transformers"


TRANSFORMERS = Library("transformers", "FP8 weights (transformers' finegrained_fp8 dequantization)", "transformers")
COMPRESSED_TENSORS = Library(
    "compressed_tensors", "FP8 weights (compressed-tensors' dequantizers)", "compressed-tensors"
)


def libraries(recipe) -> tuple[Library, ...]:
    weight = recipe.weight
    return (TRANSFORMERS,) if weight.format == "fp8" and weight.strategy != "block" else (COMPRESSED_TENSORS,)


def slices(tensor, reader, device, context, piece_bytes: int):
    """Runs of whole rows of blocks (of one matrix where the weight stacks several), at least one block row each."""
    weight = tensor.recipe.weight
    grid = weight.grid
    scales = reader.tensor(weight.scale)
    if weight.scale.dtype in ("F8_E8M0", "U8"):  # E8M0 bytes (U8 as transformers views them), by torch's own cast
        import torch

        scales = scales.view(torch.float8_e8m0fnu).to(torch.float32)
    scales = scales.to(device).reshape(-1, grid.scale_columns)
    size = DTYPES[tensor.dtype].itemsize
    row_bytes = max(1, grid.columns * size)
    step = max(grid.block_rows if grid.block_rows < grid.matrix_rows else 1, piece_bytes // row_bytes)
    if grid.block_rows < grid.matrix_rows:
        step -= step % grid.block_rows
    for matrix in range(0, grid.rows, grid.matrix_rows):
        for first in range(matrix, matrix + grid.matrix_rows, step):
            count = min(step, matrix + grid.matrix_rows - first)
            yield Slice(first * row_bytes, count * row_bytes, _rows(tensor, scales, first, count, device))


def _rows(tensor, scales, first: int, count: int, device):
    def make(read, take):

        weight = tensor.recipe.weight
        grid = weight.grid
        columns = grid.columns
        codes = read(weight.weight, first * columns, count * columns)
        codes = codes.view(DTYPES[weight.weight.dtype].torch).reshape(count, columns).to(device)
        begin = (first // grid.matrix_rows) * grid.matrix_scale_rows + (first % grid.matrix_rows) // grid.block_rows
        end = begin + -(-count // grid.block_rows)
        out_dtype = DTYPES[tensor.dtype].torch
        if weight.format == "compressed-tensors":
            dense = _compressed(weight, codes, scales[begin:end])
        elif weight.strategy == "block":
            dense = _block(weight, codes, scales[begin:end], out_dtype)
        else:
            from transformers.integrations.finegrained_fp8 import Fp8Dequantize

            dense = Fp8Dequantize(None)._dequantize_one(codes, scales.reshape(()), output_dtype=out_dtype)
        return as_bytes(dense.to(out_dtype))

    return make


def _block(weight, codes, scales, out_dtype):
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import FP8BlockDequantizer

    dequantizer = FP8BlockDequantizer(weight_block_size=weight.block, dtype=out_dtype)
    return dequantizer.process({"layer.weight": codes, "layer.weight_scale_inv": scales})["layer.weight"]


def _compressed(weight, codes, scales):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs.model_validate(dict(weight.args))
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    scale = scales.reshape(-1) if weight.strategy == "tensor" else scales.reshape(-1, weight.grid.scale_columns)
    return compressor.decompress({"weight": codes, "weight_scale": scale}, scheme)["weight"]


def reference(tensor, reader, device, context):
    return whole(tensor, reader, device, context)
