"""compressed-tensors NVFP4 checkpoints (``quant_method: "compressed-tensors"``, a config group of format
``nvfp4-pack-quantized``: llm-compressor's NVFP4 and NVFP4A16 schemes, Unsloth's and RedHatAI's *-NVFP4 releases):
which tensors they are and their checks; the arithmetic is ``nvfp4.py``'s. Also the check of a compressed-tensors
config's groups that every format reading such configs relies on (:func:`check_groups`).

A layer ``X`` of an NVFP4 group holds ``X.weight_packed`` (U8), ``X.weight_scale`` (F8_E4M3 per 16) and
``X.weight_global_scale`` (F32 [1]); NVFP4 (W4A4) schemes also ``X.input_global_scale``, a static activation scale
no dense model keeps (dropped). A config may hold several groups, each its own format ("mixed precision": NVFP4
experts beside FP8 attention beside int4 beside dense layers); each layer's group is compressed-tensors' match
(``compressed_int.matched_group``: exact names, then ``re:`` regexes, then the class ``Linear``, ``ignore`` first),
and each format reads only its groups' layers.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, ClassVar

from ..errors import CheckpointError
from ..safetensors_io.read import TensorInfo
from . import compressed_config, compressed_float, compressed_int, nvfp4
from .base import SourceFormat, register
from .packed_int import CONFIG

if TYPE_CHECKING:
    from ..safetensors_io.read import TensorReader

FORMAT = "nvfp4-pack-quantized"
# Every group format some registered format reads, and "dense" (layers stored unquantized, copied).
READ_FORMATS = (*compressed_int.FORMATS, *compressed_float.FP8_FORMATS, FORMAT, "dense")
PARTS = ("weight_packed", "weight_scale", "weight_global_scale")
ACTIVATION_NAMES = ("input_global_scale", "input_scale", "k_scale", "v_scale")
PLAN_READS = re.compile(r"\.weight_global_scale$")


def _format_of(quantization: dict, group: dict) -> str:
    chosen = group.get("format") or quantization.get("format")
    return chosen if isinstance(chosen, str) else ""


def nvfp4_groups(quantization: dict) -> dict[str, dict]:
    """The config groups stored as ``nvfp4-pack-quantized``, by name."""
    if compressed_config.shape_problem(quantization):
        return {}
    groups = quantization.get("config_groups") or {}
    return {
        name: group
        for name, group in groups.items()
        if isinstance(group, dict)
        and isinstance(group.get("weights"), dict)
        and _format_of(quantization, group) == FORMAT
    }


def config_problem(quantization: dict) -> str | None:
    """What in a compressed-tensors config's NVFP4 groups cannot be read, or None."""
    problem = compressed_config.problem(quantization)
    if problem:
        return problem
    groups = nvfp4_groups(quantization)
    if not groups:
        return f"{CONFIG}: no config group is {FORMAT}"
    for name, group in groups.items():
        weights = group["weights"]
        at = f"{CONFIG}: quantization_config config group '{name}'"
        if weights.get("type") != "float" or weights.get("num_bits") != 4 or weights.get("group_size") != 16:
            return f"{at} is {FORMAT} but its weights are not 4-bit floats in groups of 16"
        if weights.get("symmetric") is False:
            return f"{at} quantizes NVFP4 weights asymmetrically (with zero points), which is not read"
    return None


def check_groups(quantization: dict, tensors: dict[str, TensorInfo]) -> None:
    """CheckpointError for a compressed-tensors config of a shape compressed-tensors does not write, or whose settings
    say its weights are not compressed ones (``compressed_config``), or whose groups are not each one format's: a
    group stored in a format no registered format reads, or weights no format reads in it (integers as
    ``float-quantized``; its layers would be copied as codes), two groups naming the same target
    (compressed-tensors would silently take the later one), a layer two groups' regexes both match (which group it
    is in would depend on the regexes' sort order), or a group whose targets, all regexes, match no layer."""
    problem = compressed_config.problem(quantization)
    if problem:
        raise CheckpointError(problem)
    groups = quantization.get("config_groups") or {}
    read = {*compressed_int.int_groups(quantization), *compressed_float.float_groups(quantization)}
    read |= set(nvfp4_groups(quantization))
    owner: dict[str, str] = {}
    for name, group in groups.items():
        if not isinstance(group, dict):
            continue
        stored = _format_of(quantization, group)
        if group.get("weights") and stored not in READ_FORMATS:
            raise CheckpointError(
                f"{CONFIG}: quantization_config config group '{name}' stores its weights as {stored!r}, which "
                f"nf4convert does not read (it reads {', '.join(READ_FORMATS)})"
            )
        if group.get("weights") and stored != "dense" and name not in read:
            weights = group["weights"]
            raise CheckpointError(
                f"{CONFIG}: quantization_config config group '{name}' stores {weights.get('num_bits')!r}-bit "
                f"{weights.get('type', 'int')!r} weights as {stored!r}, which no format nf4convert reads"
            )
        for target in group.get("targets") or []:
            if target in owner and owner[target] != name:
                raise CheckpointError(
                    f"{CONFIG}: quantization_config config groups '{owner[target]}' and '{name}' both target {target!r}"
                )
            owner[target] = name
    layers = sorted({key.rsplit(".", 1)[0] for key in tensors if key.endswith((".weight", ".weight_packed"))})
    ignore = quantization.get("ignore") or []
    kept = [layer for layer in layers if not any(compressed_int.match_name(layer, target) for target in ignore)]
    for name, group in groups.items():
        targets = (group or {}).get("targets") or [] if isinstance(group, dict) else []
        patterns = [target for target in targets if target.startswith("re:")]
        if (
            targets
            and len(patterns) == len(targets)
            and not any(compressed_int.match_name(layer, target) for layer in kept for target in patterns)
        ):
            raise CheckpointError(
                f"{CONFIG}: quantization_config config group '{name}' targets {targets} match no layer"
            )
    regexes = [(target, name) for target, name in owner.items() if target.startswith("re:")]
    for layer in kept:
        if layer in owner:
            continue  # an exact name decides
        matching = sorted({name for target, name in regexes if compressed_int.match_name(layer, target)})
        if len(matching) > 1:
            raise CheckpointError(
                f"{CONFIG}: layer '{layer}' is matched by the regexes of config groups "
                f"{' and '.join(repr(m) for m in matching)}: which one quantizes it is ambiguous"
            )


def find_weights(tensors: dict[str, TensorInfo], reader: TensorReader, quantization: dict) -> list[nvfp4.WeightNvfp4]:
    """Every NVFP4 weight of a compressed-tensors checkpoint (``config_problem`` None), checked, in name order.
    CheckpointError naming the tensor for a part missing, a zero point, packed codes no NVFP4 group targets, and the
    checks of ``nvfp4.check_tensors``."""
    groups = nvfp4_groups(quantization)
    found = []
    for key in sorted(tensors):
        if not key.endswith(".weight_packed"):
            continue
        module = key[: -len(".weight_packed")]
        packed = tensors[key]
        matched = compressed_int.matched_group(module, quantization)
        if matched is None and module + ".weight_global_scale" in tensors:
            raise CheckpointError(
                f"{packed.path}: tensor '{key}' holds NVFP4 codes, but no config group targets '{module}'"
            )
        if matched is None or matched[0] not in groups:
            continue  # another format's group (integer packs)
        parts = {}
        for part in PARTS:
            info = tensors.get(f"{module}.{part}")
            if info is None:
                raise CheckpointError(f"{packed.path}: tensor '{key}' has no '{module}.{part}' beside it")
            parts[part] = info
        zero_point = tensors.get(module + ".weight_zero_point")
        if zero_point is not None:
            raise CheckpointError(f"{zero_point.path}: tensor '{zero_point.name}': NVFP4 zero points are not read")
        nvfp4.check_tensors(parts["weight_packed"], parts["weight_scale"], parts["weight_global_scale"], reader)
        args = tuple(sorted(groups[matched[0]]["weights"].items(), key=lambda item: item[0]))
        found.append(
            nvfp4.WeightNvfp4(
                module + ".weight",
                module,
                parts["weight_packed"],
                parts["weight_scale"],
                parts["weight_global_scale"],
                "compressed-tensors",
                args,
                matched[0],
            )
        )
    return found


def activation_keys(weights: list[nvfp4.WeightNvfp4], tensors: dict[str, TensorInfo]) -> set[str]:
    """Each NVFP4 layer's static activation scales: no dense model has a place for them."""
    return {f"{w.module}.{part}" for w in weights for part in ACTIVATION_NAMES if f"{w.module}.{part}" in tensors}


@register
class CompressedNvfp4Format(SourceFormat):
    """compressed-tensors ``nvfp4-pack-quantized`` groups. The config's other groups are other formats'."""

    name: ClassVar[str] = "compressed-tensors-nvfp4"
    family: ClassVar[str] = "compressed-tensors"
    title: ClassVar[str] = "compressed-tensors NVFP4"
    quant_methods: ClassVar[tuple[str, ...]] = ("compressed-tensors",)
    name_suffix: ClassVar[str] = r"nvfp4(?:[-_]?a16)?"
    plan_reads: ClassVar[re.Pattern] = PLAN_READS
    marks: ClassVar[str] = "compressed-tensors NVFP4 scales"
    card_tags: ClassVar[frozenset[str]] = frozenset({"nvfp4", "compressed-tensors", "llmcompressor"})

    @classmethod
    def reads_config(cls, quantization_config: dict) -> bool:
        return super().reads_config(quantization_config) and bool(nvfp4_groups(quantization_config))

    @classmethod
    def config_problem(cls, quantization_config: dict) -> str | None:
        return config_problem(quantization_config)

    @classmethod
    def is_quantization_key(cls, tensor_name: str) -> bool:
        return tensor_name.rsplit(".", 1)[-1] in ("weight_global_scale", "input_global_scale")

    @classmethod
    def exactness(cls, dtype_flag: str, several: bool) -> str:
        source = " from compressed-tensors NVFP4" if several else ""
        return (
            f"Every weight dequantized{source} is its E2M1 value times its E4M3 group scale divided by the tensor's "
            f"global scale, in fp32, rounded once to {dtype_flag}: bit for bit compressed-tensors' "
            "`NVFP4PackedCompressor.decompress` (which writes bf16; its functions in fp16 and fp32 otherwise)."
        )
