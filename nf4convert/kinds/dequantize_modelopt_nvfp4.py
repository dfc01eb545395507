"""A ModelOpt NVFP4 weight (``formats/modelopt.py``): the pieces and compute of ``dequantize_nvfp4`` with ModelOpt's
formula (the tensor's ``weight_scale_2`` multiplies; ``formats/nvfp4.py``). It also refuses, once, a ModelOpt config
that cannot be read, and drops the static activation and KV-cache scales of ModelOpt's checkpoints (both of its
formats')."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import CheckpointError
from ..formats import modelopt
from .base import Planning, register
from .dequantize_nvfp4 import DequantizeNvfp4


@register
@dataclass(frozen=True)
class DequantizeModeloptNvfp4(DequantizeNvfp4):
    """A ModelOpt NVFP4 weight, dense in the output dtype."""

    kind: ClassVar[str] = "dequantize_modelopt_nvfp4"
    format: ClassVar[type[modelopt.ModeloptNvfp4Format]] = modelopt.ModeloptNvfp4Format
    order: ClassVar[int] = 28

    @classmethod
    def plan_source(cls, planning: Planning) -> None:
        """A ModelOpt config checked; its NVFP4 layers (each checked), by their codes' name; the activation and
        KV-cache scales dropped."""
        quantization = planning.quantization
        if not modelopt.is_modelopt(quantization):
            return
        problem = modelopt.config_problem(quantization)
        if problem is not None:
            raise CheckpointError(problem)
        found = modelopt.find_weights(planning.tensors, planning.reader, quantization)
        planning.claim({weight.packed.name: cls(weight) for weight in found})
        planning.consumed.update(modelopt.activation_keys(planning.tensors))

    @property
    def source_format(self) -> str:
        return f"{self.format.name} ({self.weight.group})"
