"""A ModelOpt FP8 weight (``formats/modelopt_fp8.py``): the pieces and compute of ``dequantize_fp8``, handed the
tensor's scale rounded to the output dtype first, as ModelOpt's ``FP8QTensor.dequantize`` multiplies in that dtype."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..dtypes import DTYPES
from ..formats import modelopt, modelopt_fp8
from .base import Planning, register
from .dequantize_fp8 import DequantizeFp8


@register
@dataclass(frozen=True)
class DequantizeModeloptFp8(DequantizeFp8):
    """A ModelOpt FP8 weight times its scale, in the output dtype."""

    kind: ClassVar[str] = "dequantize_modelopt_fp8"
    format: ClassVar[type[modelopt_fp8.ModeloptFp8Format]] = modelopt_fp8.ModeloptFp8Format
    order: ClassVar[int] = 32

    @classmethod
    def plan_source(cls, planning: Planning) -> None:
        """The FP8 layers of a ModelOpt checkpoint (its config checked by ``dequantize_modelopt_nvfp4``), each
        checked, by the codes' name."""
        if not modelopt.is_modelopt(planning.quantization):
            return
        found = modelopt_fp8.find_weights(planning.tensors, planning.reader, planning.quantization)
        planning.claim({weight.weight.name: cls(weight) for weight in found})

    def scale_values(self, reader, out_code: str):
        return reader.tensor(self.weight.scale).to(DTYPES[out_code].torch), out_code
