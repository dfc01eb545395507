"""The reference of a compressed-tensors integer weight: the compressed-tensors package's own decompression.

For each weight, compressed-tensors itself resolves the layer's scheme from the quantization_config
(``QuantizationConfig``, the targets table ``apply_quantization_config`` builds, ``utils/match.py: match_targets`` and
``is_match`` for ``ignore``, the layer taken as a ``torch.nn.Linear``), the compressor is the registry's for the
scheme's format (or the config's), as transformers' ``CompressedTensorsDequantize`` takes it, and
``compressor.decompress(state_dict, scheme)`` (``PackedQuantizationCompressor`` / ``NaiveQuantizationCompressor``,
ending in ``forward_helpers._dequantize``) makes the dense rows; the output is that cast to the planned dtype.
Checked with compressed-tensors 0.20.0 and 0.20.1.
"""

from __future__ import annotations

from ...dtypes import DTYPES
from ...errors import CheckpointError
from .base import Library, Slice, as_bytes, unpacking_rows, whole

# The library verify checks for before it starts: (import name, what it recomputes, the package that installs it)
LIBRARY = Library("compressed_tensors", "compressed-tensors weights (its own decompression)", "compressed-tensors")


def libraries(recipe) -> tuple[Library, ...]:
    return (LIBRARY,)


def against(tensor, device) -> str:
    from importlib.metadata import version

    return f"compressed-tensors {version('compressed-tensors')}"


def slices(tensor, reader, device, context, piece_bytes: int):
    """Runs of whole rows, 32 at a time or more (whole words of packed zero points), each decompressed by the
    library from its rows of the layer's tensors (read once)."""
    import torch

    weight = tensor.recipe.weight
    scheme, compressor = _scheme(weight.quantization, weight.module, weight.name)
    packed = weight.codes.name.endswith(".weight_packed")
    state = {
        ("weight_packed" if packed else "weight"): reader.tensor(weight.codes).to(device),
        "weight_scale": reader.tensor(weight.scale).to(device),
    }
    if weight.zero_point is not None:
        state["weight_zero_point"] = reader.tensor(weight.zero_point).to(device)
    if packed:
        shape = reader.tensor(weight.weight_shape)
        out_features, in_features = (int(v) for v in shape.tolist())
    else:
        out_features, in_features = weight.codes.shape
    bits = scheme.weights.num_bits
    row_bytes = in_features * DTYPES[tensor.dtype].itemsize
    step = unpacking_rows(piece_bytes, row_bytes, 32, device)
    for first in range(0, out_features, step):
        count = min(step, out_features - first)
        rows = {name: value[first : first + count] for name, value in state.items() if name != "weight_zero_point"}
        if "weight_zero_point" in state:
            zero_point = state["weight_zero_point"]
            rows["weight_zero_point"] = (
                zero_point[first * bits // 32 : -(-(first + count) * bits // 32)]
                if packed
                else zero_point[first : first + count]
            )
        if packed:
            rows["weight_shape"] = torch.tensor([count, in_features], dtype=shape.dtype)
        yield Slice(first * row_bytes, count * row_bytes, _rows(tensor, compressor, scheme, rows))


def _rows(tensor, compressor, scheme, rows):
    def make(read, take):
        dense = compressor.decompress(rows, scheme)["weight"]
        return as_bytes(dense.to(DTYPES[tensor.dtype].torch))

    return make


def reference(tensor, reader, device, context):
    return whole(tensor, reader, device, context)


def _scheme(quantization: dict, module: str, name: str):
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import is_match, match_targets

    config = QuantizationConfig.model_validate(quantization)
    target_to_scheme = {}
    for scheme in config.config_groups.values():
        for target in scheme.targets:
            target_to_scheme[target] = scheme
    with torch.device("meta"):
        layer = torch.nn.Linear(1, 1)
    matched = match_targets(module, layer, target_to_scheme)
    if not matched or is_match(module, layer, config.ignore or []):
        raise CheckpointError(f"'{name}': compressed-tensors gives layer '{module}' no quantization scheme")
    scheme = target_to_scheme[matched[0]]
    return scheme, BaseCompressor.get_value_from_registry(scheme.format or config.format)
