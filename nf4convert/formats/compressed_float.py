"""compressed-tensors FP8 checkpoints (``quant_method: "compressed-tensors"``, ``format: "float-quantized"``: RedHatAI
and llm-compressor's FP8 models): which tensors they are and their checks; the arithmetic is FP8's (``fp8.py``).

A quantized linear layer ``X`` holds:

    X.weight        F8_E4M3 [out, in]   the codes
    X.weight_scale  BF16/F16/F32        its scales, by the weights' ``strategy`` in the config group:
                                        "tensor" [1], "channel" [out, 1], "block" [ceil(out / bh), ceil(in / bw)]
                                        for ``block_structure: [bh, bw]`` (the last block row/column partial)
    X.input_scale                       a static activation scale: nothing a dense weight needs (dropped)

``config_groups`` say which schemes quantize which modules (``targets``: class names or ``re:`` regexes, less
``ignore``); a group's own ``format`` overrides the global one. What is FP8 here is read from the tensors (an F8
weight with its ``weight_scale``), each scale's shape matched against the strategies the FP8 groups declare. Other
schemes (int4 ``pack-quantized``, NVFP4, MXFP4 packs) are other formats' and are left alone; a checkpoint whose
FP8 groups use a strategy other than tensor/channel/block, or asymmetric FP8 (a ``weight_zero_point``), is refused.

The reference (compressed-tensors 0.20, ``NaiveQuantizationCompressor.decompress``, which ``FloatQuantization-
Compressor`` is, and what transformers' ``CompressedTensorsConfig(dequantize=True)`` runs for a dense module through
``CompressedTensorsDequantize``) computes ``x_q.to(scale.dtype) * scale`` in the *scale's* dtype (block strategy:
on the weight padded to whole blocks), then transformers casts to the model's dtype. A bf16 (or fp16) multiply is
the exact product rounded once (an FP8 code times a bf16 scale has at most 12 significant bits, exact in fp32), so:

- bf16 output: the fp32 product rounded to bf16 (``fp8.dequantize``) is bit for bit ``decompress``'s bf16 result;
- fp32 output: the fp32 product, the exact value for bf16/fp16 scales (``decompress`` with the scale widened to
  fp32 first, losslessly). transformers' fp32 load instead widens the bf16-rounded value: it lost bits;
- fp16 output: the exact product rounded to fp16. transformers' fp16 load of a bf16-scaled checkpoint rounds twice
  (to bf16, then to fp16) and differs from it on some elements (the tests count them).

For F32 scales every path is the fp32 product then one cast, and all agree.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, ClassVar

from ..errors import CheckpointError
from ..safetensors_io.read import TensorInfo
from . import compressed_config, fp8
from .base import SourceFormat, register

if TYPE_CHECKING:
    from ..safetensors_io.read import TensorReader

FP8_FORMATS = ("float-quantized", "naive-quantized")
STRATEGIES = ("tensor", "channel", "block")
# Tensors a compressed-tensors FP8 checkpoint holds beside the weights: activation and KV-cache scales (a dense
# model has no place for them), and the weights' own.
ACTIVATION_NAMES = ("input_scale", "input_zero_point", "output_scale", "output_zero_point", "k_scale", "v_scale")
QUANTIZATION_NAMES = ("weight_scale", "weight_zero_point", *ACTIVATION_NAMES)
PLAN_READS = re.compile(r"\.weight_scale$")


def float_groups(quantization: dict) -> dict[str, dict]:
    """The config groups whose weights are floats in a float-quantized format, of any width, by group name: this
    format's to read, or to refuse."""
    groups = {}
    if compressed_config.shape_problem(quantization):
        return groups
    for name, group in (quantization.get("config_groups") or {}).items():
        weights = (group or {}).get("weights") or {}
        stored = group.get("format") or quantization.get("format")
        if weights.get("type") == "float" and stored in FP8_FORMATS:
            groups[name] = group
    return groups


def fp8_groups(quantization: dict) -> dict[str, dict]:
    """The config groups whose weights are 8-bit floats in a float-quantized format, by group name."""
    return {name: group for name, group in float_groups(quantization).items() if group["weights"].get("num_bits") == 8}


def config_problem(quantization: dict) -> str | None:
    """What in a compressed-tensors config's float-quantized groups cannot be read, or None."""
    problem = compressed_config.problem(quantization)
    if problem:
        return problem
    groups = float_groups(quantization)
    if not groups:
        if quantization.get("format") == "dense" or quantization.get("quantization_status") == "frozen":
            return "its weights are stored dense (format 'dense'): there is nothing to dequantize"
        return "it has no 8-bit float ('float-quantized') weights"
    for name, group in groups.items():
        weights = group["weights"]
        bits = weights.get("num_bits")
        if bits != 8:
            return f"config group '{name}' quantizes {bits!r}-bit float weights, not read yet (FP8 is 8-bit)"
        strategy = weights.get("strategy")
        if strategy not in STRATEGIES:
            return f"config group '{name}' quantizes FP8 weights by strategy {strategy!r}, not read yet"
        if weights.get("symmetric") is False:
            return f"config group '{name}' quantizes FP8 weights asymmetrically (with zero points), not read yet"
        if strategy == "block":
            block = weights.get("block_structure")
            if not (
                isinstance(block, list) and len(block) == 2 and all(type(size) is int and size > 0 for size in block)  # noqa: E721
            ):
                return f"config group '{name}' has block_structure {block!r}, not two positive integers"
    return None


def find_weights(tensors: dict[str, TensorInfo], reader: TensorReader, quantization: dict) -> list[fp8.WeightFp8]:
    """Every FP8 weight of a compressed-tensors checkpoint (``config_problem`` None), checked, in name order.

    CheckpointError naming the file and tensor for an F8 weight without its ``weight_scale``, a scale without its
    weight, a zero point, a scale of a dtype or shape that no FP8 group's strategy gives the weight, NaN or inf."""
    groups = fp8_groups(quantization)
    layouts = []  # (strategy, block, args) of each FP8 group, as its scales would be laid out
    for group in groups.values():
        weights = group["weights"]
        block = tuple(weights["block_structure"]) if weights.get("strategy") == "block" else None
        layouts.append((weights["strategy"], block, tuple(sorted(weights.items(), key=lambda item: item[0]))))
    # A config may quantize other layers with integer schemes (another format's: packed ``weight_packed`` or integer
    # ``weight`` codes, their scales and zero points named as FP8's): those layers are left to it.
    mixed = len(groups) < len(quantization.get("config_groups") or {})
    theirs = {
        key[: -len("weight_scale")]
        for key in tensors
        if mixed and key.endswith(".weight_scale") and _integer_layer(tensors, key[: -len("weight_scale")])
    }
    tensors = {key: info for key, info in tensors.items() if key.rpartition(".")[0] + "." not in theirs}
    found = []
    for key, info in tensors.items():
        if key.endswith(".weight_zero_point") and key[: -len("_zero_point")] in tensors:
            raise CheckpointError(f"{info.path}: tensor '{key}': asymmetric FP8 weights are not read yet")
        if key.endswith(".weight_scale_inv"):
            raise CheckpointError(
                f"{info.path}: tensor '{key}' is an 'fp8' checkpoint's scale, but the config says compressed-tensors"
            )
    for prefix, weight, scale in fp8.pairs(tensors, ("weight_scale",)):
        at_scale = f"{scale.path}: tensor '{scale.name}'"
        if len(weight.shape) != 2:
            shape = list(weight.shape)
            raise CheckpointError(f"{weight.path}: tensor '{weight.name}' is an FP8 weight of shape {shape}, not 2-D")
        grid, layout = _grid(weight, scale, layouts)
        if grid is None:
            expected = "; ".join(_expected(weight, *layout[:2]) for layout in layouts)
            raise CheckpointError(
                f"{at_scale} has shape {list(scale.shape)}, but the FP8 config groups expect {expected}"
            )
        fp8.check_finite(scale, reader)
        found.append(fp8.WeightFp8(prefix + "weight", weight, scale, grid, "compressed-tensors", layout[0], layout[2]))
    return found


def _integer_layer(tensors: dict[str, TensorInfo], prefix: str) -> bool:
    """Whether the layer ``prefix`` holds integer codes (packed, or an integer ``weight``), not FP8 ones."""
    weight = tensors.get(prefix + "weight")
    return prefix + "weight_packed" in tensors or (weight is not None and weight.dtype[0] in "IU")


def _grid(weight: TensorInfo, scale: TensorInfo, layouts: list) -> tuple[fp8.Grid | None, tuple]:
    rows, columns = weight.shape
    for layout in layouts:
        strategy, block, _ = layout
        if strategy == "tensor" and math.prod(scale.shape) == 1 and len(scale.shape) <= 1:
            return fp8.Grid(rows, columns, max(1, rows), max(1, rows), max(1, columns)), layout
        if strategy == "channel" and list(scale.shape) == [rows, 1]:
            return fp8.Grid(rows, columns, rows, 1, max(1, columns)), layout
        if strategy == "block" and list(scale.shape) == [-(-rows // block[0]), -(-columns // block[1])]:
            return fp8.Grid(rows, columns, rows, *block), layout
    return None, ()


def _expected(weight: TensorInfo, strategy: str, block) -> str:
    rows, columns = weight.shape
    if strategy == "tensor":
        return "[1] (tensor)"
    if strategy == "channel":
        return f"[{rows}, 1] (channel)"
    return f"[{-(-rows // block[0])}, {-(-columns // block[1])}] (blocks of {block[0]} x {block[1]})"


def is_quantization_key(name: str) -> bool:
    """A tensor only a compressed-tensors checkpoint has (scales, zero points)."""
    return name.rsplit(".", 1)[-1] in QUANTIZATION_NAMES


@register
class CompressedFloatFormat(SourceFormat):
    """compressed-tensors FP8 (``float-quantized``) checkpoints: RedHatAI's and llm-compressor's FP8 models. Their
    integer schemes are another format's, though both share ``quant_method`` (a config may hold both)."""

    name: ClassVar[str] = "compressed-tensors-fp8"
    family: ClassVar[str] = "compressed-tensors"
    title: ClassVar[str] = "compressed-tensors FP8"
    quant_methods: ClassVar[tuple[str, ...]] = ("compressed-tensors",)
    name_suffix: ClassVar[str] = r"fp8(?:[-_](?:dynamic|block|static))?"
    plan_reads: ClassVar[re.Pattern] = PLAN_READS
    marks: ClassVar[str] = "a compressed-tensors FP8 scale"
    card_tags: ClassVar[frozenset[str]] = frozenset({"fp8", "fp8-dynamic", "compressed-tensors", "llmcompressor"})

    @classmethod
    def reads_config(cls, quantization_config: dict) -> bool:
        return super().reads_config(quantization_config) and bool(float_groups(quantization_config))

    @classmethod
    def config_problem(cls, quantization_config: dict) -> str | None:
        return config_problem(quantization_config)

    @classmethod
    def is_quantization_key(cls, tensor_name: str) -> bool:
        return is_quantization_key(tensor_name)

    @classmethod
    def exactness(cls, dtype_flag: str, several: bool) -> str:
        source = " from compressed-tensors FP8" if several else ""
        if dtype_flag == "fp32":
            return (
                f"Every weight dequantized{source} is its e4m3 code times its scale as one fp32 multiply: the exact "
                "product where the scales are bf16 or fp16, what compressed-tensors' `decompress` gives with the "
                "scale widened to fp32 (transformers' fp32 load of it goes through bf16 and keeps less)."
            )
        return (
            f"Every weight dequantized{source} is its e4m3 code times its scale rounded once to {dtype_flag}: bit "
            "for bit compressed-tensors' `decompress` in the scale's dtype where that is "
            f"{dtype_flag} (what transformers' `CompressedTensorsConfig(dequantize=True)` loads), else its exact "
            "product rounded once."
        )
