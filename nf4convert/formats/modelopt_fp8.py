"""ModelOpt FP8 checkpoints (``quant_method: "modelopt"``, ``quant_algo: "FP8"``, or FP8 layers of a MIXED_PRECISION
config; ``modelopt.py`` says what the config and the rest hold): ``X.weight`` F8_E4M3 and ``X.weight_scale`` F32, one
per tensor (ModelOpt's ``amax / 448``). The arithmetic is FP8's (``fp8.py``) in ModelOpt's order and dtype.

ModelOpt's ``FP8QTensor.dequantize`` (``torch/quantization/qtensor/fp8_tensor.py``, 0.47.0) computes
``quantized_data.to(dtype) * scale.to(dtype)``: the scale is *rounded to the output dtype first*, then one multiply in
that dtype. An E4M3 code (4 significant bits) times a bf16 or fp16 value is exact in fp32, so that multiply is the
exact product rounded once, and:

    out = round_T( fp32(code) * fp32(round_T(s)) )

which is ``fp8.dequantize`` handed the scale rounded to ``T``: bf16 and fp16 outputs differ from a product with the
fp32 scale (``fp8``'s formula) wherever the scale is not a ``T`` value; fp32 output is the fp32 product.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, ClassVar

from ..errors import CheckpointError
from ..safetensors_io.read import TensorInfo
from . import fp8, modelopt
from .base import SourceFormat, register

if TYPE_CHECKING:
    from ..safetensors_io.read import TensorReader


def find_weights(tensors: dict[str, TensorInfo], reader: TensorReader, quantization: dict) -> list[fp8.WeightFp8]:
    """Every FP8 weight of a ModelOpt checkpoint (F8 codes with one F32 scale), checked, in name order; the NVFP4
    layers (whose E4M3 block scales are F8 too) left out. CheckpointError naming the tensor for an F8 weight without
    its scale, a scale of the wrong dtype or shape, a NaN or infinite scale, a layer the config says is not FP8."""
    import dataclasses

    nvfp4_modules = {key[: -len(".weight_scale_2")] for key in tensors if key.endswith(".weight_scale_2")}
    rest = {key: info for key, info in tensors.items() if key.rpartition(".")[0] not in nvfp4_modules}
    found = []
    for weight in fp8.find_weights(rest, reader, None):
        module = weight.name[: -len(".weight")]
        modelopt.check_algorithm(weight.weight, module, quantization, "FP8", modelopt.FP8_ALGOS)
        if weight.scale.dtype != "F32":
            raise CheckpointError(
                f"{weight.scale.path}: tensor '{weight.scale.name}' is {weight.scale.dtype}; ModelOpt's FP8 "
                "scales are F32"
            )
        found.append(dataclasses.replace(weight, format="modelopt"))
    return found


@register
class ModeloptFp8Format(SourceFormat):
    """ModelOpt FP8 (``quant_algo`` FP8, or such layers of a MIXED_PRECISION config)."""

    name: ClassVar[str] = "modelopt-fp8"
    family: ClassVar[str] = "ModelOpt"
    title: ClassVar[str] = "ModelOpt FP8 (e4m3, one scale a tensor)"
    quant_methods: ClassVar[tuple[str, ...]] = ("modelopt",)
    name_suffix: ClassVar[str] = r"fp8"
    plan_reads: ClassVar[re.Pattern] = re.compile(r"\.weight_scale$")
    marks: ClassVar[str] = "a ModelOpt FP8 scale"
    card_tags: ClassVar[frozenset[str]] = frozenset({"modelopt", "fp8"})

    @classmethod
    def config_problem(cls, quantization_config: dict) -> str | None:
        problem = modelopt.config_problem(quantization_config)
        if problem is None and not modelopt.algorithms(quantization_config) & set(modelopt.FP8_ALGOS):
            return "its ModelOpt config has no FP8 layers"
        return problem

    @classmethod
    def is_quantization_key(cls, tensor_name: str) -> bool:
        return False  # its scales are named as FP8's (``fp8.py`` says so)

    @classmethod
    def exactness(cls, dtype_flag: str, several: bool) -> str:
        source = " from ModelOpt FP8" if several else ""
        return (
            f"Every weight dequantized{source} is its e4m3 code times its tensor's scale rounded to {dtype_flag}, "
            f"one multiply in {dtype_flag}: bit for bit ModelOpt's `FP8QTensor.dequantize`."
        )
