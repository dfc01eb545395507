"""The reference of an NVFP4 weight, computed by compressed-tensors only, in runs of whole rows.

compressed-tensors' ``NVFP4PackedCompressor.decompress`` (``compressors/nvfp4/base.py``, 0.20) on each run's rows of
``weight_packed``, ``weight_scale`` and ``weight_global_scale``, with the config group's own ``QuantizationArgs``:
it unpacks to bf16 and dequantizes in bf16 (``forward_helpers._dequantize``: the scale over the global scale, times
the values, cast), whatever the model's dtype; the output is that bf16 weight cast to its dtype, as a model loaded
through the library holds it. Each row depends on its own codes and scales alone.
"""

from __future__ import annotations

from ...dtypes import DTYPES
from .base import Library, Slice, as_bytes, unpacking_rows, whole

LIBRARY = Library("compressed_tensors", "NVFP4 weights (compressed-tensors' own decompression)", "compressed-tensors")


def libraries(recipe) -> tuple[Library, ...]:
    return (LIBRARY,)


def against(tensor, device) -> str:
    from importlib.metadata import version

    return f"compressed-tensors {version('compressed-tensors')} (NVFP4PackedCompressor)"


def slices(tensor, reader, device, context, piece_bytes: int):
    """Runs of whole rows, each decompressed by the library from its rows of the layer's tensors (read once)."""
    weight = tensor.recipe.weight
    packed = reader.tensor(weight.packed).to(device)
    scale = reader.tensor(weight.scale).to(device)
    global_scale = reader.tensor(weight.global_scale).to(device)
    rows, columns = weight.shape
    row_bytes = columns * DTYPES[tensor.dtype].itemsize
    step = unpacking_rows(piece_bytes, row_bytes, 1, device)
    for first in range(0, rows, step):
        count = min(step, rows - first)
        state = {
            "weight_packed": packed[first : first + count],
            "weight_scale": scale[first : first + count],
            "weight_global_scale": global_scale,
        }
        yield Slice(first * row_bytes, count * row_bytes, _rows(tensor, weight, state))


def _rows(tensor, weight, state):
    def make(read, take):
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        args = QuantizationArgs.model_validate(dict(weight.args))
        scheme = QuantizationScheme(targets=["Linear"], weights=args)
        out_dtype = DTYPES[tensor.dtype].torch
        compressor = BaseCompressor.get_value_from_registry("nvfp4-pack-quantized")
        dense = compressor.decompress(dict(state), scheme)["weight"]
        return as_bytes(dense.to(out_dtype))

    return make


def reference(tensor, reader, device, context):
    return whole(tensor, reader, device, context)
