"""AWQ checkpoints (``quant_method: "awq"``, written by AutoAWQ and GPTQModel): which tensors they are, their checks,
and the arithmetic that rebuilds each dense weight.

A linear layer ``X`` [out, in] quantized to 4 bits in groups of ``group_size`` input columns (-1: one group), with a
zero point per group, holds one of two layouts (``version``, or ``format``, in the config; "gemm" by default):

    GEMM   X.qweight I32 [in, out / 8]        eight codes per word along the output dimension, in the interleaved
           X.qzeros  I32 [in / group, out / 8] order 0, 2, 4, 6, 1, 3, 5, 7: nibble k of a word holds column
           X.scales  F16|BF16 [in / group, out]  8 * word + ORDER[k]
    GEMV   X.qweight I32 [out, in / 8]        eight codes per word along the input dimension, in plain order
           X.qzeros  I32 [out, width]          zeros of each row's groups, plain order, padded to ``width`` words
           X.scales  F16|BF16 [out, width * 8] (``calculate_zeros_width``: groups / 8 rounded up, then to a
                                               multiple of 128 / group_size for groups under 128)

Every group is whole (``in`` a multiple of the group size): GPTQModel repeats each group's zero and scale
``group_size`` times and cannot read a partial one.

The reference is GPTQModel, the library transformers loads AWQ checkpoints with: gptqmodel 7.7.0's
``quantization/awq/utils/packing_utils.py: dequantize_gemm`` (what its portable ``AwqTorchLinear`` computes with):

    W^T = (codes - zeros[group]) * scales[group]          in the scales' dtype, codes in AWQ_REVERSE_ORDER

Its CUDA GEMM kernels compute the same (an fp16/bf16 subtract, exact, then one rounded multiply), and its GEMV kernel
multiplies the same exact difference by the scale in fp32; GPTQModel has no torch dequantization of the GEMV layout,
so a GEMV weight is the same formula over the GEMV layout. GPTQModel's file-level ``utils/model_dequant.py:
convert_awq_file`` is not followed: it unpacks GEMM nibbles in plain order (no AWQ_REVERSE_ORDER), so it permutes
every group of eight output columns, and it multiplies in fp32 before casting.

Why it is exact on every device: unpacking, the reordering and the difference are integer operations; the difference
(at most 15 in magnitude) converts exactly; the one multiply rounds once, to nearest even, in the scales' dtype (torch
multiplies fp16 and bf16 in fp32 on CPU and CUDA and rounds; the product of the scale and a 5-bit integer is exact in
fp32). A non-finite scale makes NaN bits that differ by device (see ``formats/bnb8``).
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..errors import CheckpointError
from ..safetensors_io.read import TensorInfo
from .base import SourceFormat, register
from .packed_int import (
    CONFIG,
    SCALE_DTYPES,
    check_dtype,
    check_finite_scales,
    check_matrix,
    check_shape,
    config_int,
    scaled,
    unpack,
    where,
)

if TYPE_CHECKING:
    import torch

    from ..safetensors_io.read import TensorReader

PARTS = ("qweight", "qzeros", "scales")
LAYOUTS = ("gemm", "gemv")
BITS = 4
PACK = 8  # codes per int32 word
# AWQ's GEMM interleave (AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7): column 8w + j is in nibble REVERSE_ORDER[j] of word w.
REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
# Pieces of a GEMM weight start at a multiple of this (whole words); a GEMV weight's pieces are any runs of rows.
PIECE_ALIGN = PACK
# What a plan reads of an AWQ checkpoint: the scales (one value per group and output column), to refuse non-finite
# ones; headers say everything else.
PLAN_READS = re.compile(r"\.scales$")


@dataclass(frozen=True)
class AwqSettings:
    layout: str  # "gemm" or "gemv"
    group_size: int  # -1: one group


@dataclass(frozen=True)
class AwqWeight:
    """One AWQ weight: its output name, its source tensors, its layout and dimensions. The verify reference reads
    ``name``, the three tensors and ``quantization`` (it derives the rest itself)."""

    name: str
    qweight: TensorInfo
    qzeros: TensorInfo
    scales: TensorInfo
    layout: str
    group_size: int  # the effective size: -1 resolved to in_features
    in_features: int
    out_features: int
    quantization: dict

    @property
    def shape(self) -> tuple:
        return (self.out_features, self.in_features)

    @property
    def groups(self) -> int:
        return self.in_features // self.group_size if self.group_size else 0

    @property
    def sources(self) -> tuple[TensorInfo, ...]:
        return (self.qweight, self.qzeros, self.scales)

    @property
    def dtype(self) -> str:
        """The dtype GPTQModel dequantizes to: the scales'."""
        return self.scales.dtype


def read_settings(quantization: dict) -> AwqSettings:
    """The AWQ settings of a quantization_config, checked; CheckpointError naming the setting otherwise."""
    config_int(quantization, "bits", (BITS,), default=BITS)
    group_size = config_int(quantization, "group_size", lambda v: v == -1 or v > 0, default=128)
    # transformers' AwqConfig: the legacy "version" overrides "format"; GEMM when neither is set.
    chosen = quantization.get("version") or quantization.get("format") or "gemm"
    if not isinstance(chosen, str) or chosen.lower() not in LAYOUTS:
        raise CheckpointError(
            f"{CONFIG}: quantization_config version {chosen!r} is not an AWQ packing this reads ({', '.join(LAYOUTS)})"
        )
    return AwqSettings(chosen.lower(), group_size)


def zeros_width(in_features: int, group_size: int) -> int:
    """The GEMV layout's qzeros columns (AutoAWQ's and GPTQModel's ``calculate_zeros_width``)."""
    multiplier = 1 if group_size >= 128 else {64: 2, 32: 4, 16: 8}[group_size]
    base = math.ceil(in_features // group_size / PACK)
    return math.ceil(base / multiplier) * multiplier


def find_weights(
    tensors: dict[str, TensorInfo],
    quantization: dict,
    model_type: str | None = None,
    reader: TensorReader | None = None,
) -> list[AwqWeight]:
    """Every AWQ weight of a checkpoint, checked, in name order (``tensors``: the whole checkpoint; with ``reader``,
    each weight's scales are read to refuse a NaN or infinite one). Raises ``CheckpointError`` naming the file and
    tensor for anything GPTQModel could not dequantize the same way."""
    settings = read_settings(quantization)
    prefixes = {key[: -len(part)] for key in tensors for part in PARTS if key.endswith("." + part)}
    found = []
    for prefix in sorted(prefixes):
        parts = {part: tensors.get(prefix + part) for part in PARTS}
        if parts["qweight"] is None:
            orphan = next(info for info in parts.values() if info is not None)
            if orphan.name.endswith(".scales") and len(orphan.shape) == 1:
                raise CheckpointError(
                    f"{where(orphan)} scales an activation (AWQ's ScaledActivation, {model_type or 'this model'}); "
                    "a dense model has no place for it"
                )
            raise CheckpointError(f"{where(orphan)} is AWQ data but '{prefix}qweight' is not in the checkpoint")
        for part, info in parts.items():
            if info is None:
                raise CheckpointError(f"{where(parts['qweight'])} has no '{prefix}{part}' beside it")
        weight = _checked(prefix + "weight", parts, settings, quantization)
        if reader is not None:  # the GEMV layout pads each row's scales: its groups' are checked
            columns = None if weight.layout == "gemm" else weight.groups
            check_finite_scales(reader, weight.scales, "AWQ scales", columns)
        found.append(weight)
    return found


def _checked(name: str, parts: dict, settings: AwqSettings, quantization: dict) -> AwqWeight:
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    for info, what in ((qweight, "AWQ codes"), (qzeros, "AWQ zeros"), (scales, "AWQ scales")):
        check_matrix(info, what)
    check_dtype(qweight, ("I32",), "AWQ codes")
    check_dtype(qzeros, ("I32",), "AWQ zeros")
    check_dtype(scales, SCALE_DTYPES, "AWQ scales")
    gemm = settings.layout == "gemm"
    in_features, out_features = (
        (qweight.shape[0], scales.shape[1]) if gemm else (qweight.shape[1] * PACK, qweight.shape[0])
    )
    group_size = in_features if settings.group_size == -1 else settings.group_size
    if in_features % group_size:
        raise CheckpointError(
            f"{where(qweight)}: {in_features} input columns are not whole groups of {group_size}; "
            "AWQ dequantizes whole groups only"
        )
    groups = in_features // group_size
    if gemm:
        if out_features % PACK:
            raise CheckpointError(f"{where(scales)}: {out_features} output columns are not whole 8-code AWQ words")
        check_shape(qweight, (in_features, out_features // PACK), "8 4-bit codes a word along each input row")
        check_shape(qzeros, (groups, out_features // PACK), f"4-bit zeros of each group of {group_size}")
        check_shape(scales, (groups, out_features), f"one scale per group of {group_size} and output column")
    else:
        if group_size < 128 and group_size not in (16, 32, 64):
            raise CheckpointError(f"{CONFIG}: AWQ GEMV packs groups of 16, 32, 64 or 128 and more, not {group_size}")
        width = zeros_width(in_features, group_size)
        check_shape(qzeros, (out_features, width), f"each row's 4-bit group zeros padded to {width} words")
        check_shape(scales, (out_features, width * PACK), f"each row's group scales padded to {width * PACK}")
    return AwqWeight(
        name, qweight, qzeros, scales, settings.layout, group_size, in_features, out_features, quantization
    )


def dequantize_gemm(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    *,
    group_size: int,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Output rows of an AWQ GEMM weight, [n, in], in the scales' dtype (or that cast to ``out_dtype``; or written into
    ``out``).

    A piece is a run of ``n`` output features starting at a multiple of PIECE_ALIGN: ``qweight`` its words [in, n/8],
    ``qzeros`` [groups, n/8], ``scales`` [groups, n]. It stands alone: every element reads only its own column's code,
    zero and scale, and the interleave stays inside a word.
    """
    count = scales.shape[1]
    zeros = _interleaved(unpack(qzeros, BITS, count, dim=1), count)
    if sys.byteorder == "little":
        codes = _gemm_codes(qweight)
    else:  # the words' bytes are not the stream's order: unpacked as numbers
        codes = _interleaved(unpack(qweight, BITS, count, dim=1), count).T
    return scaled(codes, zeros.T, scales.T, group_size=group_size, out_dtype=out_dtype, out=out)


def _gemm_codes(qweight: torch.Tensor) -> torch.Tensor:
    """The codes of GEMM words [in, n/8] as output rows [n, in] (uint8): the words transposed (an eighth of the
    codes' count), then each output row is one half of one byte of its word (``REVERSE_ORDER``: column ``j`` of a word
    is its half ``REVERSE_ORDER[j] % 2`` of byte ``REVERSE_ORDER[j] // 2``, little-endian), made for all words at
    once."""
    import torch

    in_features, words = qweight.shape
    raw = qweight.T.contiguous().view(torch.uint8).view(words, in_features, 4).permute(0, 2, 1).contiguous()
    codes = torch.empty(words, PACK, in_features, dtype=torch.uint8, device=qweight.device)
    for column, nibble in enumerate(REVERSE_ORDER):
        byte = raw[:, nibble // 2]
        if nibble % 2:
            torch.bitwise_right_shift(byte, BITS, out=codes[:, column])
        else:
            torch.bitwise_and(byte, (1 << BITS) - 1, out=codes[:, column])
    return codes.view(words * PACK, in_features)


def _interleaved(codes: torch.Tensor, count: int) -> torch.Tensor:
    """Codes [rows, count] in stream order made AWQ's column order: column ``8w + j`` is stream code ``8w +
    REVERSE_ORDER[j]``. Stream code ``4p + 2h + n`` (byte ``2p + h`` of the word, half ``n``) is column ``4h + 2n + p``:
    a permutation of views, no gather."""
    rows = codes.shape[0]
    return codes.reshape(rows, count // PACK, 2, 2, 2).permute(0, 1, 3, 4, 2).reshape(rows, count)


def dequantize_gemv(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    *,
    group_size: int,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Output rows of an AWQ GEMV weight, [n, in], in the scales' dtype (or that cast to ``out_dtype``; or written into
    ``out``): ``qweight`` [n, in/8], ``qzeros`` [n, width] and ``scales`` [n, width * 8] of any run of ``n`` rows (each
    row stands alone)."""
    in_features = qweight.shape[1] * PACK
    groups = in_features // group_size
    codes = unpack(qweight, BITS, in_features, dim=1)
    zeros = unpack(qzeros, BITS, groups, dim=1)
    return scaled(codes, zeros, scales[:, :groups], group_size=group_size, out_dtype=out_dtype, out=out)


@register
class Awq(SourceFormat):
    """AWQ checkpoints (AutoAWQ, GPTQModel): 4-bit codes with zero points, GEMM and GEMV packings."""

    name: ClassVar[str] = "awq"
    family: ClassVar[str] = "AWQ"
    title: ClassVar[str] = "AWQ"
    quant_methods: ClassVar[tuple[str, ...]] = ("awq",)
    name_suffix: ClassVar[str] = r"awq(?:[-_](?:int4|4-?bits?|gemm|gemv))*"
    plan_reads: ClassVar[re.Pattern] = PLAN_READS
    marks: ClassVar[str] = "AWQ zeros"
    card_tags: ClassVar[frozenset[str]] = frozenset({"awq", "autoawq", "int4", "4-bit"})
    card_fields: ClassVar[str] = r"awq"

    @classmethod
    def config_problem(cls, quantization_config: dict) -> str | None:
        try:
            read_settings(quantization_config)
        except CheckpointError as error:
            return str(error)
        return None

    @classmethod
    def is_quantization_key(cls, tensor_name: str) -> bool:
        return tensor_name.rsplit(".", 1)[-1] in PARTS

    @classmethod
    def exactness(cls, dtype_flag: str, several: bool) -> str:
        source = " from AWQ" if several else ""
        return (
            f"Every weight dequantized{source} is bit for bit what GPTQModel's AWQ dequantization (`dequantize_gemm`, "
            "the weights transformers' AWQ layers compute with) gives, in the scales' dtype, then cast to "
            f"{dtype_flag} where that differs."
        )
