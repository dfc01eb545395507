"""ModelOpt checkpoints (NVIDIA's Model Optimizer, ``quant_method: "modelopt"``: NVIDIA's *-NVFP4, *-FP4 and *-FP8
releases, what ModelOpt's ``export_hf_checkpoint`` writes): what their config says, which tensors are NVFP4 weights
and their checks (this module's format); the FP8 weights are ``modelopt_fp8.py``'s. NVFP4's arithmetic is
``nvfp4.py``'s (ModelOpt's formula: the tensor scale multiplies).

ModelOpt (0.47.0, ``torch/export/unified_export_hf.py``) writes ``hf_quant_config.json``, ``{"producer": ...,
"quantization": {"quant_algo": ..., "group_size": 16, "exclude_modules": [...], "kv_cache_quant_algo": ...}}``, and
the same in config.json's ``quantization_config`` (``convert_hf_config.py: convert_hf_quant_config_format``:
``quant_method: "modelopt"``, ``quant_algo``, compressed-tensors-shaped ``config_groups``, ``ignore`` the excluded
modules); older exports write the file alone, which ``model/config.py`` reads where config.json has no
quantization_config. ``quant_algo`` says what the layers hold (layer ``X``):

    NVFP4, W4A16_NVFP4  X.weight U8 [out, in / 2] (two E2M1 codes a byte, the low nibble first), X.weight_scale
                        F8_E4M3 [out, in / 16], X.weight_scale_2 F32 [] (or [1]): ``amax / (6 * 448)``
    FP8                 X.weight F8_E4M3 [out, in], X.weight_scale F32 [] (or [1]), one per tensor
    MIXED_PRECISION     each listed layer its own of those (``quantized_layers: {X: {"quant_algo": ...}}``)

Beside them ``X.input_scale`` (a static activation scale) and the KV-cache ``k_scale`` / ``v_scale``: no dense model
keeps them (dropped). Excluded layers are dense (copied). Refused: any other ``quant_algo`` (the AWQ variants'
``pre_quant_scale`` folds an activation scale into the weight, no dequantization), a group size other than 16, a
layer whose tensors are not its ``quant_algo``'s.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, ClassVar

from ..errors import CheckpointError
from ..safetensors_io.read import TensorInfo
from . import nvfp4
from .base import SourceFormat, register

if TYPE_CHECKING:
    from ..safetensors_io.read import TensorReader

NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
FP8_ALGOS = ("FP8",)
MIXED = "MIXED_PRECISION"
READ_ALGOS = (*NVFP4_ALGOS, *FP8_ALGOS, MIXED)
PARTS = ("weight", "weight_scale", "weight_scale_2")
ACTIVATION_NAMES = ("input_scale", "k_scale", "v_scale")
PLAN_READS = re.compile(r"\.weight_scale_2$")
CONFIG = "config.json"


def is_modelopt(quantization: dict | None) -> bool:
    method = (quantization or {}).get("quant_method")
    return isinstance(method, str) and method.lower() == "modelopt"


def layer_algorithms(quantization: dict) -> dict[str, str]:
    """MIXED_PRECISION: each listed layer's quant_algo (else empty)."""
    layers = quantization.get("quantized_layers") or {}
    if not isinstance(layers, dict):
        return {}
    return {name: str(entry.get("quant_algo")) for name, entry in layers.items() if isinstance(entry, dict)}


def algorithms(quantization: dict) -> set[str]:
    """The quant_algos a config's layers are in."""
    algo = quantization.get("quant_algo")
    return set(layer_algorithms(quantization).values()) if algo == MIXED else {str(algo)}


def config_problem(quantization: dict) -> str | None:
    """What in a ModelOpt config cannot be read, or None."""
    at = f"{CONFIG} (or hf_quant_config.json): quantization_config"
    algo = quantization.get("quant_algo")
    if algo not in READ_ALGOS:
        return f"{at} has ModelOpt quant_algo {algo!r}, which is not read (nf4convert reads {', '.join(READ_ALGOS)})"
    if algo == MIXED:
        unread = sorted(algorithms(quantization) - {*NVFP4_ALGOS, *FP8_ALGOS})
        if unread or not layer_algorithms(quantization):
            return f"{at}: MIXED_PRECISION layers of quant_algo {unread or 'none listed'} are not read"
    size = quantization.get("group_size", 16)
    if algorithms(quantization) & set(NVFP4_ALGOS) and size != 16:
        return f"{at} has NVFP4 group_size {size!r}; NVFP4 scales one group of 16"
    return None


def layer_algorithm(module: str, quantization: dict) -> str | None:
    """The quant_algo of layer ``module`` (None: a MIXED_PRECISION layer not listed)."""
    if quantization.get("quant_algo") == MIXED:
        return layer_algorithms(quantization).get(module)
    return quantization.get("quant_algo")


def check_algorithm(info: TensorInfo, module: str, quantization: dict, held: str, algos: tuple[str, ...]) -> None:
    """CheckpointError for a layer holding ``held`` weights where the config says its quant_algo is not one of
    ``algos``."""
    algo = layer_algorithm(module, quantization)
    if algo not in algos:
        raise CheckpointError(
            f"{info.path}: tensor '{info.name}' holds {held} weights, but the ModelOpt config says layer "
            f"'{module}' is {algo or 'not quantized'!s}"
        )


def find_weights(tensors: dict[str, TensorInfo], reader: TensorReader, quantization: dict) -> list[nvfp4.WeightNvfp4]:
    """Every NVFP4 weight of a ModelOpt checkpoint, checked, in name order. CheckpointError naming the tensor for a
    part missing, an AWQ ``pre_quant_scale``, U8 codes without their scales, a layer the config says is not NVFP4,
    and the checks of ``nvfp4.check_tensors``."""
    found = []
    for key in sorted(tensors):
        info = tensors[key]
        if key.endswith(".pre_quant_scale"):
            raise CheckpointError(
                f"{info.path}: tensor '{key}' is an AWQ pre-quantization scale (ModelOpt's *_AWQ algorithms), which "
                "is folded into the activations, not dequantized: not read"
            )
        if info.dtype == "U8" and key.endswith(".weight") and key[: -len("weight")] + "weight_scale_2" not in tensors:
            raise CheckpointError(
                f"{info.path}: tensor '{key}' is U8 (packed NVFP4 codes?) without its '{key[: -len('weight')]}"
                "weight_scale_2' beside it"
            )
        if not key.endswith(".weight_scale_2"):
            continue
        module = key[: -len(".weight_scale_2")]
        parts = {}
        for part in PARTS:
            part_info = tensors.get(f"{module}.{part}")
            if part_info is None:
                raise CheckpointError(f"{info.path}: tensor '{key}' has no '{module}.{part}' beside it")
            parts[part] = part_info
        check_algorithm(parts["weight"], module, quantization, "NVFP4", NVFP4_ALGOS)
        nvfp4.check_tensors(
            parts["weight"], parts["weight_scale"], parts["weight_scale_2"], reader, global_shapes=([], [1])
        )
        found.append(
            nvfp4.WeightNvfp4(
                module + ".weight",
                module,
                parts["weight"],
                parts["weight_scale"],
                parts["weight_scale_2"],
                "modelopt",
                group=str(layer_algorithm(module, quantization)),
            )
        )
    return found


def activation_keys(tensors: dict[str, TensorInfo]) -> set[str]:
    """The static activation and KV-cache scales: no dense model has a place for them."""
    return {name for name in tensors if name.rpartition(".")[2] in ACTIVATION_NAMES}


@register
class ModeloptNvfp4Format(SourceFormat):
    """ModelOpt NVFP4 (``quant_algo`` NVFP4 or W4A16_NVFP4, or such layers of a MIXED_PRECISION config)."""

    name: ClassVar[str] = "modelopt-nvfp4"
    family: ClassVar[str] = "ModelOpt"
    title: ClassVar[str] = "ModelOpt NVFP4"
    quant_methods: ClassVar[tuple[str, ...]] = ("modelopt",)
    name_suffix: ClassVar[str] = r"(?:nv)?fp4"
    plan_reads: ClassVar[re.Pattern] = PLAN_READS
    marks: ClassVar[str] = "ModelOpt NVFP4 scales"
    card_tags: ClassVar[frozenset[str]] = frozenset({"modelopt", "nvfp4", "fp4"})

    @classmethod
    def config_problem(cls, quantization_config: dict) -> str | None:
        problem = config_problem(quantization_config)
        if problem is None and not algorithms(quantization_config) & set(NVFP4_ALGOS):
            return "its ModelOpt config has no NVFP4 layers"
        return problem

    @classmethod
    def is_quantization_key(cls, tensor_name: str) -> bool:
        return tensor_name.rsplit(".", 1)[-1] == "weight_scale_2"

    @classmethod
    def exactness(cls, dtype_flag: str, several: bool) -> str:
        source = " from ModelOpt NVFP4" if several else ""
        return (
            f"Every weight dequantized{source} is its E2M1 value times its E4M3 group scale times the tensor's "
            f"weight_scale_2, in fp32, rounded once to {dtype_flag}: bit for bit ModelOpt's "
            "`NVFP4QTensor.dequantize`."
        )
