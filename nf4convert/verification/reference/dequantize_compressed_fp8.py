"""The reference of a compressed-tensors FP8 weight: compressed-tensors' own ``decompress`` (its
``FloatQuantizationCompressor``, what ``CompressedTensorsConfig(dequantize=True)`` runs), in runs of whole rows of
scales, as ``dequantize_fp8``'s reference computes it for such a weight (that module says how)."""

from __future__ import annotations

from .base import Library
from .dequantize_fp8 import COMPRESSED_TENSORS, reference, slices

__all__ = ["against", "libraries", "reference", "slices"]


def against(tensor, device) -> str:
    return "compressed-tensors"


def libraries(recipe) -> tuple[Library, ...]:
    return (COMPRESSED_TENSORS,)
