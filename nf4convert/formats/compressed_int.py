"""compressed-tensors integer checkpoints (``quant_method: "compressed-tensors"``, written by llm-compressor): which
tensors they are, their checks, and the arithmetic that rebuilds each dense weight.

A linear layer ``X`` [out, in] whose config group (``config_groups``: targets -> weights args) gives ``num_bits``,
a ``strategy`` of "group" (``group_size`` input columns a scale) or "channel" (one scale a row) and ``symmetric``:

    pack-quantized   X.weight_packed      I32 [out, ceil(in * bits / 32)]  codes plus 2**(bits-1), packed along
                                                                          each row (the bit stream of packed_int)
                     X.weight_shape       I64|I32 [2]                      [out, in]
                     X.weight_scale       F16|BF16|F32 [out, in / group]   ([out, 1] for "channel")
                     X.weight_zero_point  I32 [ceil(out * bits / 32), in / group]  (asymmetric only) zero points
                                                                          plus 2**(bits-1), packed along dim 0
    naive-quantized  X.weight             I8 [out, in]                     signed codes
    (int-quantized)  X.weight_scale, X.weight_zero_point (I8, unpacked; asymmetric only) as above

Packed bit widths are 2, 4 and 8 only: the only ones whose packing is the same in every compressed-tensors version
(0.20 packs 3, 5, 6 and 7 bits densely across words, earlier versions left each word's spare bits empty).

The reference is the compressed-tensors package (0.20.0): ``compressors/pack_quantized/base.py:
PackedQuantizationCompressor.decompress`` and ``compressors/naive_quantized/base.py:
NaiveQuantizationCompressor.decompress``, both ending in ``quantization/lifecycle/forward_helpers.py: _dequantize``:

    W = (codes.to(scale.dtype) - zero_point.to(scale.dtype)) * scale          in the scale's dtype

Why it is exact on every device: unpacking and the difference are integer operations, and the float subtraction the
reference makes is exact too (codes and zeros are integers of at most 8 bits, their difference at most 255 in
magnitude, exact in fp16, bf16 and fp32); the one multiply rounds once, to nearest even, in the scale's dtype (fp16
and bf16 products are exact in fp32, where torch computes them on CPU and CUDA; an fp32 multiply is one IEEE
operation). A non-finite scale makes NaN bits that differ by device (see ``formats/bnb8``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..errors import CheckpointError
from ..safetensors_io.read import TensorInfo
from . import compressed_config
from .base import SourceFormat, register
from .packed_int import CONFIG, check_dtype, check_finite_scales, check_matrix, check_shape, scaled, unpack, where

if TYPE_CHECKING:
    import torch

    from ..safetensors_io.read import TensorReader

PACKED, NAIVE, INT = "pack-quantized", "naive-quantized", "int-quantized"
FORMATS = (PACKED, NAIVE, INT)
PACKED_BITS = (2, 4, 8)
SCALE_DTYPES = ("F16", "BF16", "F32")
# Tensors of these integer layouts besides the weight itself (verify: leftovers in a dense output).
QUANTIZATION_KEYS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx")
# (the activation and KV-cache parts below are quantization keys too)
# An integer layer's activation quantization (W8A8), and the KV cache's: not part of a dense model.
ACTIVATION_PARTS = ("input_scale", "input_zero_point", "output_scale", "output_zero_point")
KV_CACHE_PARTS = ("k_scale", "v_scale", "q_scale", "k_zero_point", "v_zero_point", "q_zero_point")
# Pieces start at a multiple of this: whole words of packed zero points for every packed bit width.
PIECE_ALIGN = 32
# What a plan reads: each packed weight's shape (two integers), and each weight's scales (one value per group), to
# refuse non-finite ones.
PLAN_READS = re.compile(r"\.(?:weight_shape|weight_scale)$")


@dataclass(frozen=True)
class Scheme:
    """A config group's weights, as far as dequantization goes."""

    group: str  # the config group's name
    format: str
    bits: int
    strategy: str  # "group" or "channel"
    group_size: int | None
    symmetric: bool


@dataclass(frozen=True)
class CompressedIntWeight:
    """One compressed-tensors integer weight. The verify reference reads ``name``, ``module``, the tensors and
    ``quantization`` (it resolves the config group itself, with compressed-tensors' matching)."""

    name: str  # "X.weight"
    module: str  # "X"
    scheme: Scheme
    codes: TensorInfo  # weight_packed (I32) or the I8 weight
    scale: TensorInfo
    zero_point: TensorInfo | None
    weight_shape: TensorInfo | None  # packed only
    in_features: int
    out_features: int
    quantization: dict

    @property
    def shape(self) -> tuple:
        return (self.out_features, self.in_features)

    @property
    def sources(self) -> tuple[TensorInfo, ...]:
        return tuple(t for t in (self.codes, self.weight_shape, self.scale, self.zero_point) if t is not None)

    @property
    def dtype(self) -> str:
        """The dtype compressed-tensors decompresses to: the scale's."""
        return self.scale.dtype

    def zero_rows(self, first: int, count: int) -> tuple[int, int]:
        """The packed zero-point rows ``[begin, end)`` holding output rows ``[first, first + count)`` (``first`` a
        multiple of PIECE_ALIGN)."""
        bits = self.scheme.bits
        return first * bits // 32, math.ceil((first + count) * bits / 32)


def _format_of(quantization: dict, group: dict) -> str:
    chosen = group.get("format") or quantization.get("format")
    return chosen if isinstance(chosen, str) else ""


def int_groups(quantization: dict) -> dict[str, dict]:
    """The config groups whose weights are integers in a layout read here (float groups belong to another format)."""
    if compressed_config.shape_problem(quantization):
        return {}
    groups = quantization.get("config_groups") or {}
    return {
        name: group
        for name, group in groups.items()
        if isinstance(group, dict) and isinstance(group.get("weights"), dict)
        and group["weights"].get("type", "int") == "int" and _format_of(quantization, group) in FORMATS
    }  # fmt: skip


def read_scheme(name: str, group: dict, quantization: dict) -> Scheme:
    """A config group's integer weights scheme, checked; CheckpointError naming the group and setting otherwise."""
    weights, fmt = group["weights"], _format_of(quantization, group)
    at = f"{CONFIG}: quantization_config config group '{name}'"
    bits = weights.get("num_bits", 8)
    allowed = PACKED_BITS if fmt == PACKED else range(1, 9)
    if type(bits) is not int or bits not in allowed:  # noqa: E721
        raise CheckpointError(f"{at} has {bits!r}-bit weights; {fmt} is read for {', '.join(map(str, allowed))} bits")
    group_size = weights.get("group_size")
    strategy = weights.get("strategy") or ("tensor" if group_size is None else "group" if group_size > 0 else "channel")
    if strategy not in ("group", "channel"):
        raise CheckpointError(f"{at} uses strategy {strategy!r}; only 'group' and 'channel' are read")
    if strategy == "group" and (type(group_size) is not int or group_size <= 0):  # noqa: E721
        raise CheckpointError(f"{at} uses strategy 'group' with group_size {group_size!r}")
    if weights.get("actorder") == "group":
        raise CheckpointError(
            f"{at} uses actorder 'group' (weight_g_idx), which compressed-tensors 0.20 no longer decompresses"
        )
    if weights.get("dynamic") or weights.get("block_structure"):
        raise CheckpointError(f"{at} has dynamic or block-structured weights, which are not stored integer codes")
    return Scheme(
        name, fmt, bits, strategy, group_size if strategy == "group" else None, bool(weights.get("symmetric", True))
    )


def config_problem(quantization: dict) -> str | None:
    """Why a compressed-tensors config holds no integer weights read here, or a setting that cannot be read."""
    problem = compressed_config.problem(quantization)
    if problem:
        return problem
    groups = int_groups(quantization)
    if not groups:
        return f"{CONFIG}: no config group has integer weights in {', '.join(FORMATS)}"
    try:
        for name, group in groups.items():
            read_scheme(name, group, quantization)
    except CheckpointError as error:
        return str(error)
    return None


def match_name(name: str, target: str) -> bool:
    # compressed-tensors' match_name: "re:" targets are regular expressions matched at the start, others exact names
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def matched_group(module: str, quantization: dict) -> tuple[str, dict] | None:
    """The config group compressed-tensors gives linear layer ``module`` (``apply_quantization_config``): among the
    targets (a later group's target replacing an earlier one's), exact names first, then regular expressions, each in
    sorted order, then the class name "Linear" (every layer holding quantized codes is a linear layer); None if
    ignored or untargeted (or the config is of no shape compressed-tensors writes). The group may be another format's
    (float weights)."""
    if compressed_config.shape_problem(quantization):
        return None
    table = {}
    for name, group in (quantization.get("config_groups") or {}).items():
        for target in (group.get("targets") or []) if isinstance(group, dict) else []:
            table[target] = (name, group)
    ignore = quantization.get("ignore") or []
    if any(match_name(module, target) or target == "Linear" for target in ignore):
        return None
    ordered = sorted(table, key=lambda target: ("re:" in target, target))
    matched = [target for target in ordered if match_name(module, target)]
    matched += [target for target in ordered if target == "Linear" and target not in matched]
    return table[matched[0]] if matched else None


def scheme_for(module: str, quantization: dict) -> Scheme | None:
    """The integer scheme compressed-tensors gives linear layer ``module``; None if ignored, untargeted, or in a
    group whose weights are not integers in a layout read here."""
    matched = matched_group(module, quantization)
    if matched is None or matched[0] not in int_groups(quantization):
        return None
    return read_scheme(*matched, quantization)


def find_weights(tensors: dict[str, TensorInfo], reader: TensorReader, quantization: dict) -> list[CompressedIntWeight]:
    """Every compressed-tensors integer weight of a checkpoint, checked, in name order (``tensors``: the whole
    checkpoint; each ``weight_shape`` is read, two integers, and each scale, to refuse a NaN or infinite one).
    Raises ``CheckpointError`` naming the file and tensor for anything compressed-tensors could not decompress the
    same way."""
    modules = {key[: -len(".weight_packed")] for key in tensors if key.endswith(".weight_packed")}
    modules |= {
        key[: -len(".weight_scale")]
        for key in tensors
        if key.endswith(".weight_scale") and getattr(tensors.get(key[: -len("_scale")]), "dtype", None) == "I8"
    }
    found = []
    for module in sorted(modules):
        anchor = tensors.get(module + ".weight_packed") or tensors[module + ".weight"]
        if tensors.get(module + ".weight_g_idx") is not None:
            g_idx = tensors[module + ".weight_g_idx"]
            raise CheckpointError(
                f"{where(g_idx)}: activation-ordered groups are not decompressed by compressed-tensors 0.20"
            )
        matched = matched_group(module, quantization)
        if matched is not None and matched[0] not in int_groups(quantization):
            continue  # a float group's layer: another format's
        scheme = scheme_for(module, quantization)
        if scheme is None:
            raise CheckpointError(
                f"{where(anchor)} holds integer codes, but no integer config group targets '{module}'"
            )
        found.append(
            _packed(module, scheme, tensors, reader, quantization)
            if scheme.format == PACKED
            else _naive(module, scheme, tensors, reader, quantization)
        )
    return found


def activation_keys(weights: list[CompressedIntWeight], tensors: dict[str, TensorInfo], quantization: dict) -> set[str]:
    """The tensors of a quantized model's activations, which a dense model has no place for: each integer layer's
    input and output scales and zero points, and the attention's KV-cache scales where the config quantizes the KV
    cache. transformers' dense (decompressed) model loads none of them."""
    found = {
        f"{weight.module}.{part}"
        for weight in weights
        for part in ACTIVATION_PARTS
        if f"{weight.module}.{part}" in tensors
    }
    if quantization.get("kv_cache_scheme"):
        found |= {name for name in tensors if name.rsplit(".", 1)[-1] in KV_CACHE_PARTS}
    return found


def _part(tensors: dict, module: str, part: str, anchor: TensorInfo) -> TensorInfo:
    info = tensors.get(f"{module}.{part}")
    if info is None:
        raise CheckpointError(f"{where(anchor)} has no '{module}.{part}' beside it")
    return info


def _zero_point(tensors: dict, module: str, scheme: Scheme, anchor: TensorInfo) -> TensorInfo | None:
    info = tensors.get(module + ".weight_zero_point")
    if scheme.symmetric:
        if info is not None:
            raise CheckpointError(f"{where(info)}: zero points beside symmetric config group '{scheme.group}'")
        return None
    return _part(tensors, module, "weight_zero_point", anchor)


def _scale_columns(scale: TensorInfo, scheme: Scheme, in_features: int) -> int:
    if scheme.strategy == "channel":
        return 1
    if in_features % scheme.group_size:
        raise CheckpointError(
            f"{where(scale)}: {in_features} input columns are not whole groups of {scheme.group_size}; "
            "compressed-tensors decompresses whole groups only"
        )
    return in_features // scheme.group_size


def _packed(
    module: str, scheme: Scheme, tensors: dict, reader: TensorReader, quantization: dict
) -> CompressedIntWeight:
    packed = tensors[module + ".weight_packed"]
    shape_info = _part(tensors, module, "weight_shape", packed)
    scale = _part(tensors, module, "weight_scale", packed)
    zero_point = _zero_point(tensors, module, scheme, packed)
    check_matrix(packed, "packed integer codes")
    check_dtype(packed, ("I32",), "packed integer codes")
    check_dtype(shape_info, ("I64", "I32"), "the dense weight's shape")
    if tuple(shape_info.shape) != (2,):
        raise CheckpointError(f"{where(shape_info)} has shape {list(shape_info.shape)}, [2] expected (out, in)")
    out_features, in_features = (int(v) for v in reader.tensor(shape_info).tolist())
    if out_features < 0 or in_features < 0:
        raise CheckpointError(f"{where(shape_info)} says shape [{out_features}, {in_features}]")
    bits = scheme.bits
    check_shape(
        packed,
        (out_features, math.ceil(in_features * bits / 32)),
        f"[{out_features}, {in_features}] {bits}-bit codes in 32-bit words",
    )
    columns = _scale_columns(scale, scheme, in_features)
    check_dtype(scale, SCALE_DTYPES, "scales")
    check_shape(scale, (out_features, columns), f"one scale per row and {scheme.strategy}")
    check_finite_scales(reader, scale, "scales")
    if zero_point is not None:
        check_dtype(zero_point, ("I32",), f"{bits}-bit zero points packed along the rows")
        check_shape(
            zero_point, (math.ceil(out_features * bits / 32), columns), f"{bits}-bit zero points packed along the rows"
        )
    return CompressedIntWeight(
        module + ".weight",
        module,
        scheme,
        packed,
        scale,
        zero_point,
        shape_info,
        in_features,
        out_features,
        quantization,
    )


def _naive(module: str, scheme: Scheme, tensors: dict, reader: TensorReader, quantization: dict) -> CompressedIntWeight:
    codes = tensors[module + ".weight"]
    scale = _part(tensors, module, "weight_scale", codes)
    zero_point = _zero_point(tensors, module, scheme, codes)
    check_matrix(codes, "integer codes")
    out_features, in_features = codes.shape
    columns = _scale_columns(scale, scheme, in_features)
    check_dtype(scale, SCALE_DTYPES, "scales")
    check_shape(scale, (out_features, columns), f"one scale per row and {scheme.strategy}")
    check_finite_scales(reader, scale, "scales")
    if zero_point is not None:
        check_dtype(zero_point, ("I8",), "zero points")
        check_shape(zero_point, (out_features, columns), "one zero point per scale")
    return CompressedIntWeight(
        module + ".weight", module, scheme, codes, scale, zero_point, None, in_features, out_features, quantization
    )


def dequantize_packed(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    *,
    bits: int,
    in_features: int,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of a pack-quantized weight, [n, in], in the scale's dtype (or that cast to ``out_dtype``; or written into
    ``out``).

    A piece is a run of ``n`` rows starting at a multiple of PIECE_ALIGN: ``packed`` [n, words], ``scale`` [n, columns]
    and, asymmetric, ``zero_point`` the packed rows holding its zeros (``CompressedIntWeight.zero_rows``). Each row
    stands alone (its codes, scales and zeros). Codes and zero points are stored plus 2**(bits-1): their difference is
    that of the stored values, and a symmetric code's value is its stored value minus that offset."""
    import torch

    rows = packed.shape[0]
    codes = unpack(packed, bits, in_features, dim=1)
    if zero_point is None:
        zeros = torch.full((rows, scale.shape[1]), 1 << (bits - 1), dtype=torch.int16, device=packed.device)
    else:
        zeros = unpack(zero_point, bits, rows, dim=0)
    return _dequantize(codes, scale, zeros, out_dtype, out)


def dequantize_naive(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    *,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows of a naive-quantized weight, [n, in]: ``codes`` int8 [n, in], ``scale`` [n, columns], ``zero_point`` int8
    [n, columns] or None; in the scale's dtype (or that cast to ``out_dtype``; or written into ``out``)."""
    return _dequantize(codes, scale, zero_point, out_dtype, out)


def _dequantize(codes, scale, zeros, out_dtype, out):
    columns = scale.shape[1]
    group_size = codes.shape[1] // columns if columns else 1
    return scaled(codes, zeros, scale, group_size=max(group_size, 1), out_dtype=out_dtype, out=out)


@register
class CompressedInt(SourceFormat):
    """compressed-tensors integer weights (pack-quantized, naive-quantized, int-quantized config groups). Float
    groups of the same quant_method (fp8) are another format's: recognition is per config group and per layer."""

    name: ClassVar[str] = "compressed-int"
    family: ClassVar[str] = "compressed-tensors"
    title: ClassVar[str] = "compressed-tensors"
    quant_methods: ClassVar[tuple[str, ...]] = ("compressed-tensors",)
    # -W4A16, -quantized.w4a16 (RedHatAI, neuralmagic), -w4a16-asym, -W8A8, -int4-w4a16...
    name_suffix: ClassVar[str] = r"(?:quantized[._-])?(?:w4a16|w8a16|w8a8|w4a8|w4a4|w2a16)(?:[-_](?:asym|sym|g\d+))*"
    plan_reads: ClassVar[re.Pattern] = PLAN_READS
    marks: ClassVar[str] = "compressed-tensors integer scales"
    card_tags: ClassVar[frozenset[str]] = frozenset(
        {"compressed-tensors", "llmcompressor", "llm-compressor", "w4a16", "w8a16", "w8a8", "int4", "int8"}
    )
    card_fields: ClassVar[str] = r"compress"

    @classmethod
    def config_problem(cls, quantization_config: dict) -> str | None:
        """Its problem with a compressed-tensors config (a config of float groups alone is another format's to
        read: the registry refuses a config only where every format reading it finds a problem)."""
        return config_problem(quantization_config)

    @classmethod
    def claims_config(cls, quantization_config: dict) -> bool:
        return super().reads_config(quantization_config) and bool(int_groups(quantization_config))

    @classmethod
    def is_quantization_key(cls, tensor_name: str) -> bool:
        return tensor_name.rsplit(".", 1)[-1] in (*QUANTIZATION_KEYS, *ACTIVATION_PARTS, *KV_CACHE_PARTS)

    @classmethod
    def exactness(cls, dtype_flag: str, several: bool) -> str:
        source = " from compressed-tensors integers" if several else ""
        return (
            f"Every weight dequantized{source} is bit for bit what compressed-tensors' decompression gives (the "
            f"weights transformers loads with run_compressed=False), in the scales' dtype, then cast to {dtype_flag} "
            "where that differs. Activation quantization (input scales and zero points, KV-cache scales), where the "
            "scheme had it, is not kept: a dense model computes in its own dtype."
        )
