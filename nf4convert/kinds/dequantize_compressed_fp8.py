"""A compressed-tensors FP8 weight (``float-quantized``, ``formats/compressed_float.py``): the arithmetic, pieces and
compute of an ``fp8`` checkpoint's (``dequantize_fp8``), the scales laid out by the config group's strategy, the
product rounded to a bf16 or fp16 scale's dtype before the output's, as compressed-tensors' ``decompress`` does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..formats import compressed_float, fp8
from .base import Planning, register
from .dequantize_fp8 import DequantizeFp8


@register
@dataclass(frozen=True)
class DequantizeCompressedFp8(DequantizeFp8):
    """A compressed-tensors FP8 weight times its scales, in the scale's dtype, then the output dtype."""

    kind: ClassVar[str] = "dequantize_compressed_fp8"
    format: ClassVar[type[compressed_float.CompressedFloatFormat]] = compressed_float.CompressedFloatFormat
    order: ClassVar[int] = 31
    activation_names: ClassVar[tuple[str, ...]] = compressed_float.ACTIVATION_NAMES

    @classmethod
    def find_weights(cls, planning: Planning, quantization: dict) -> list[fp8.WeightFp8]:
        return compressed_float.find_weights(planning.tensors, planning.reader, quantization)

    @property
    def through(self) -> str | None:
        """compressed-tensors multiplies in the scale's dtype, then casts: its product rounded to a bf16 or fp16
        scale's dtype first."""
        return self.weight.scale.dtype if self.weight.scale.dtype in ("BF16", "F16") else None
