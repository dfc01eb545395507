"""GPTQ checkpoints (``quant_method: "gptq"``, written by AutoGPTQ, optimum and GPTQModel): which tensors they are,
their checks, and the arithmetic that rebuilds each dense weight.

A linear layer ``X`` [out, in] quantized to ``bits`` (2, 3, 4 or 8) in groups of ``group_size`` input columns
(-1: one group) holds:

    X.qweight  I32 [ceil(in * bits / 32), out]   codes packed along the input dimension (I8/I16 words also
                                                 occur for 2/4/8 bits: GPTQModel's pack_dtype)
    X.qzeros   I32 [groups, ceil(out * bits / 32)] zero points packed along the output dimension
    X.scales   F16|BF16 [groups, out]            groups = ceil(in / group_size): the last group may be partial
    X.g_idx    I32 [in]                          each input column's group (a permutation of groups with desc_act)

Packing is the little-endian bit stream of ``formats/packed_int`` (3-bit: whole blocks of 32 codes in 3 words).
``checkpoint_format`` (or ``format``; default "gptq") says how zeros are stored: "gptq" (v1) stores each zero
minus one, "gptq_v2" stores it as is.

The reference is GPTQModel, the library transformers loads GPTQ checkpoints with (through optimum). gptqmodel 7.7.0
turns v1 zeros into v2 when it loads them (``utils/model.py: convert_gptq_v1_to_v2_format_module``): for 2, 4 and 8
bits it adds 0x11111111 (the field-wise one, per bit width) to each packed *word*, in the word's own two's-complement
width, so a field holding all ones carries into the next field, exactly undoing the word-wise subtraction its own
v1 export makes (``convert_gptq_v2_to_v1_format_module``); for 3 bits it adds one to each field modulo 8. Then its
torch kernel (``nn_modules/qlinear/torch.py: TorchLinear.dequantize_weight``, the same formula in
``PackableQuantLinear.dequantize_weight`` and its Triton ``dequant``) computes

    W[:, o]^T = scales[g_idx, o] * (codes[:, o] - zeros[g_idx, o])        in the scales' dtype, as [in, out]

and this module computes the same, transposed to [out, in].

Why it is exact on every device: unpacking, the zero fix and the difference are integer operations; the difference
is at most 255 in magnitude, exactly representable in fp16 and bf16 (8 significant bits), so converting it is exact;
the one multiply rounds once, to nearest even, in the scales' dtype: torch computes fp16 and bf16 products in fp32
on CPU and CUDA alike and rounds the result, and the fp32 product of an 11- (or 8-) bit scale and a 9-bit integer is
exact, so both give the correctly rounded product (as do GPTQModel's Triton kernel, which multiplies in fp32 and
casts, and its torch.compile'd kernel). One exception: a non-finite scale gives NaN bits that differ by device (inf
times zero), as the module docstring of ``formats/bnb8`` explains; GPTQ writers store finite scales.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..errors import CheckpointError
from ..safetensors_io.read import TensorInfo
from .base import SourceFormat, register
from .packed_int import (
    CONFIG,
    SCALE_DTYPES,
    WORD_BITS,
    check_dtype,
    check_finite_scales,
    check_matrix,
    check_shape,
    config_int,
    host_array,
    packed_length,
    scaled,
    unpack,
    where,
)

if TYPE_CHECKING:
    import torch

    from ..safetensors_io.read import TensorReader

PARTS = ("qweight", "qzeros", "scales", "g_idx")
BITS = (2, 3, 4, 8)
# The group sizes GPTQModel's kernels load (TorchLinear.SUPPORTS_GROUP_SIZE), besides one group of all input columns
GROUP_SIZES = (16, 32, 64, 128, 256, 512, 1024)
# checkpoint_format -> zeros stored minus one
ZERO_FORMATS = {"gptq": True, "gptq_v2": False}
# A piece of output rows starts at a multiple of this: whole qzeros words for every bit width and word size.
PIECE_ALIGN = 32
PLAN_READS = re.compile(r"\.(?:g_idx|scales)$")


@dataclass(frozen=True)
class GptqSettings:
    bits: int
    group_size: int  # -1: one group of all input columns
    v1: bool  # zeros stored minus one


@dataclass(frozen=True)
class GptqWeight:
    """One GPTQ weight: its output name, its source tensors and what the config says of them. The verify reference
    reads ``name``, the four tensors and ``quantization`` (it derives the rest itself)."""

    name: str  # the dense weight, "X.weight"
    qweight: TensorInfo
    qzeros: TensorInfo
    scales: TensorInfo
    g_idx: TensorInfo
    bits: int
    group_size: int  # as configured; -1 one group
    v1: bool
    quantization: dict
    in_order: bool = False  # g_idx is each column's index over the group size (no desc_act permutation)
    grouped: bool = False  # g_idx puts the columns in whole groups, permuted (desc_act): ``order`` sorts them

    @property
    def in_features(self) -> int:
        return self.g_idx.shape[0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def shape(self) -> tuple:
        return (self.out_features, self.in_features)

    @property
    def sources(self) -> tuple[TensorInfo, ...]:
        return (self.qweight, self.qzeros, self.scales, self.g_idx)

    @property
    def dtype(self) -> str:
        """The dtype GPTQModel dequantizes to: the scales'."""
        return self.scales.dtype

    def zero_words(self, first: int, count: int) -> tuple[int, int]:
        """The qzeros columns ``[begin, end)`` that hold output features ``[first, first + count)``; ``first`` a
        multiple of PIECE_ALIGN, so the piece's words start with its first feature."""
        width = WORD_BITS[self.qzeros.dtype]
        end = min(packed_length(first + count, self.bits, width), self.qzeros.shape[1])
        return first * self.bits // width, end


def read_settings(quantization: dict) -> GptqSettings:
    """The GPTQ settings of a quantization_config, checked; CheckpointError naming the setting otherwise."""
    bits = config_int(quantization, "bits", BITS)
    group_size = config_int(quantization, "group_size", lambda v: v == -1 or v > 0)
    # transformers' GPTQConfig: "checkpoint_format" (the legacy field) overrides "format"; v1 when neither is set.
    chosen = quantization.get("checkpoint_format") or quantization.get("format") or "gptq"
    if not isinstance(chosen, str) or chosen.lower() not in ZERO_FORMATS:
        raise CheckpointError(
            f"{CONFIG}: quantization_config checkpoint_format {chosen!r} is not a GPTQ layout this reads "
            f"({', '.join(ZERO_FORMATS)})"
        )
    if quantization.get("dynamic"):
        raise CheckpointError(f"{CONFIG}: quantization_config 'dynamic' (per-module GPTQ settings) is not read yet")
    return GptqSettings(bits, group_size, ZERO_FORMATS[chosen.lower()])


def find_weights(tensors: dict[str, TensorInfo], reader: TensorReader, quantization: dict) -> list[GptqWeight]:
    """Every GPTQ weight of a checkpoint, checked, in name order. ``tensors`` is the whole checkpoint (a weight's parts
        may sit in different shards); each ``g_idx`` is read (one int per input column) to check its groups, and each
    ``scales`` (one value per group and output column) to refuse a NaN or infinite one. Raises
        ``CheckpointError`` naming the file and tensor for anything GPTQModel could not dequantize the same way."""
    settings = read_settings(quantization)
    prefixes = {key[: -len(part)] for key in tensors for part in PARTS if key.endswith("." + part)}
    found = []
    for prefix in sorted(prefixes):
        parts = {part: tensors.get(prefix + part) for part in PARTS}
        if parts["qweight"] is None:
            orphan = next(info for info in parts.values() if info is not None)
            raise CheckpointError(f"{where(orphan)} is GPTQ data but '{prefix}qweight' is not in the checkpoint")
        for part, info in parts.items():
            if info is None:
                raise CheckpointError(f"{where(parts['qweight'])} has no '{prefix}{part}' beside it")
        weight = GptqWeight(
            prefix + "weight", *parts.values(), settings.bits, settings.group_size, settings.v1, quantization
        )
        _check(weight)
        check_finite_scales(reader, weight.scales, "GPTQ scales")
        in_order, grouped = _check_groups(weight, reader)
        found.append(dataclasses.replace(weight, in_order=in_order, grouped=grouped))
    return found


def unused_biases(weights: list[GptqWeight], tensors: dict[str, TensorInfo], config: dict | None) -> set[str]:
    """The ``X.bias`` tensors beside quantized layers whose dense model has no bias there: AutoGPTQ saved a (zero)
    bias for every quantized layer, which transformers' GPTQ layers (made with a bias only where the model has one)
    never load; a dense checkpoint holding them would load with unexpected keys. Only a layer the model is seen to
    have, with no bias, leaves its bias out: where transformers cannot build the model from config.json, or the
    model has no layer of that name (under its base model's prefix or without it), the bias is kept (nothing says
    the model lacks it)."""
    biases = [weight.name.removesuffix("weight") + "bias" for weight in weights]
    biases = [name for name in biases if name in tensors]
    if not biases or not isinstance(config, dict):
        return set()
    from ..model.skeleton import meta_model

    _, _, unbuilt, module = meta_model({k: v for k, v in config.items() if k != "quantization_config"})
    absent = {name for name in biases if _without_bias(module, name.removesuffix(".bias"))}
    return set() if unbuilt() else absent


def _without_bias(module, path: str) -> bool:
    """Whether the model ``module`` (meta_model's: path -> module) has the layer ``path`` and that layer has no bias.
    A checkpoint names its layers as the model with a head does ("model.layers.0..."); a config.json without
    ``architectures`` builds the base model, whose names lack the head's prefix ("layers.0...")."""
    root = module("")
    prefix = getattr(root, "base_model_prefix", "") or ""
    candidates = [path]
    if prefix and path.startswith(prefix + "."):
        candidates.append(path[len(prefix) + 1 :])
    elif prefix:
        candidates.append(f"{prefix}.{path}")
    for candidate in candidates:
        layer = module(candidate)
        if layer is not None:
            return getattr(layer, "bias", None) is None
    return False


def groups(weight: GptqWeight) -> int:
    """How many groups of input columns the weight has (the last may be partial)."""
    return math.ceil(weight.in_features / group_columns(weight)) if weight.in_features else 0


def _check(weight: GptqWeight) -> None:
    qweight, qzeros, scales, g_idx = weight.sources
    for info, what in ((qweight, "GPTQ codes"), (qzeros, "GPTQ zeros"), (scales, "GPTQ scales")):
        check_matrix(info, what)
    check_dtype(qweight, tuple(WORD_BITS) if weight.bits != 3 else ("I32",), f"{weight.bits}-bit GPTQ codes")
    check_dtype(qzeros, (qweight.dtype,), "GPTQ zeros, packed like the codes")
    check_dtype(scales, SCALE_DTYPES, "GPTQ scales")
    check_dtype(g_idx, ("I32", "I64"), "GPTQ group index")
    if len(g_idx.shape) != 1:
        raise CheckpointError(f"{where(g_idx)} has shape {list(g_idx.shape)}, one group per input column expected")
    if weight.group_size not in (-1, *GROUP_SIZES, weight.in_features):
        raise CheckpointError(
            f"{where(scales)}: GPTQ groups of {weight.group_size} input columns; GPTQModel loads groups of "
            f"{', '.join(map(str, GROUP_SIZES))} or of all {weight.in_features}"
        )
    width, bits = WORD_BITS[qweight.dtype], weight.bits
    rows = packed_length(weight.in_features, bits, width)
    check_shape(
        qweight, (rows, weight.out_features), f"{weight.in_features} {bits}-bit codes of {width}-bit words per column"
    )
    count = groups(weight)
    check_shape(scales, (count, weight.out_features), f"one scale per group of {weight.group_size} and output column")
    check_shape(qzeros, (count, packed_length(weight.out_features, bits, width)), f"{bits}-bit zeros of each group")
    if bits == 3:
        # GPTQModel reads 3-bit words in blocks of three (32 codes) and its zeros must fill whole blocks.
        if qweight.shape[0] % 3:
            raise CheckpointError(
                f"{where(qweight)} ends inside a 3-word block of 32 3-bit codes ({qweight.shape[0]} rows); "
                "GPTQ 3-bit packing fills whole blocks"
            )
        if weight.out_features % 32:
            raise CheckpointError(
                f"{where(qzeros)}: 3-bit zeros of {weight.out_features} output columns end inside a 3-word block; "
                "GPTQ 3-bit packing needs a multiple of 32"
            )


def _check_groups(weight: GptqWeight, reader: TensorReader) -> tuple[bool, bool]:
    """CheckpointError for a group index outside the groups; whether the columns are in order (no permutation), and
    whether they make whole groups (each of the group size but the last: a permutation of the in-order index)."""
    if not weight.in_features:
        return True, True
    import numpy as np

    index = host_array(reader, weight.g_idx)
    count = groups(weight)
    if int(index.min()) < 0 or int(index.max()) >= count:
        raise CheckpointError(
            f"{where(weight.g_idx)} holds groups {int(index.min())}..{int(index.max())}, outside 0..{count - 1}"
        )
    in_order = np.arange(weight.in_features) // group_columns(weight)
    return bool((index == in_order).all()), bool((np.bincount(index, minlength=count) == np.bincount(in_order)).all())


def group_columns(weight: GptqWeight) -> int:
    """Input columns a group (all of them for one group)."""
    return weight.in_features if weight.group_size == -1 else weight.group_size


def group_order(index):
    """The columns' permutation that puts a whole-grouped (``grouped``) group index's groups in order (a stable sort,
    numpy int32)."""
    import numpy as np

    return np.argsort(index, kind="stable").astype(np.int32)


def dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    *,
    bits: int,
    v1: bool,
    out_dtype: torch.dtype | None = None,
    group_size: int | None = None,
    in_features: int | None = None,
    out: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Output rows of a GPTQ weight, [n, in], in the scales' dtype (or that result cast to ``out_dtype``; or written
    into ``out``).

    A piece is a run of ``n`` output features starting at a multiple of PIECE_ALIGN: ``qweight`` its columns of the
    codes [rows, n], ``qzeros`` the words holding its zeros [groups, words] (``GptqWeight.zero_words``), ``scales`` its
    columns [groups, n], ``g_idx`` the whole [in], or None where the columns are in order (``GptqWeight.in_order``:
    then ``group_size``, -1 for one group, and ``in_features`` say the groups), or in whole groups permuted
    (``GptqWeight.grouped``: then ``order`` too, the permutation that sorts them, ``group_order()``). Each piece stands
    alone: every output
    element reads only its own column's codes, zeros and scales, and the v1 fix adds within a word. All on one device.
    """
    if g_idx is not None:
        in_features, groups = g_idx.shape[0], dict(index=g_idx)
    else:
        groups = dict(group_size=in_features if group_size == -1 else group_size, order=order)
    count = qweight.shape[1]
    codes = unpack(qweight, bits, in_features, dim=0).T  # [n, in]: each output row's codes, unpacked row-contiguous
    zeros = unpack(_v2_zeros(qzeros, bits) if v1 else qzeros, bits, count, dim=1)  # [groups, n]
    if v1 and bits == 3:
        zeros = (zeros + 1) & 7
    return scaled(codes, zeros.T, scales.T, **groups, out_dtype=out_dtype, out=out)


def _v2_zeros(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """v1 zeros made v2 as GPTQModel does for 2, 4 and 8 bits: one added to every field by one add per word, in the
    word's two's-complement width (a field of all ones carries into the next). 3-bit zeros are fixed per field after
    unpacking (GPTQModel's own choice for words whose fields straddle)."""
    import torch

    if bits == 3:
        return qzeros
    width = qzeros.element_size() * 8
    ones = sum(1 << shift for shift in range(0, width, bits))
    unsigned = (qzeros.to(torch.int64) + ones) & ((1 << width) - 1)
    # back to the word's signed dtype (its width is what unpack() reads); the values fit, so the cast is exact
    return torch.where(unsigned >= 1 << (width - 1), unsigned - (1 << width), unsigned).to(qzeros.dtype)


@register
class Gptq(SourceFormat):
    """GPTQ checkpoints (AutoGPTQ, optimum, GPTQModel), v1 and v2 zeros, 2, 3, 4 and 8 bits."""

    name: ClassVar[str] = "gptq"
    family: ClassVar[str] = "GPTQ"
    title: ClassVar[str] = "GPTQ"
    quant_methods: ClassVar[tuple[str, ...]] = ("gptq",)
    # -GPTQ, -GPTQ-Int4 (Qwen), -GPTQ-4bit-128g-actorder_True (TheBloke's branches and older repos)
    name_suffix: ClassVar[str] = r"gptq(?:[-_](?:int[2348]|[2348]-?bits?|\d+g|act-?order(?:_true)?))*"
    plan_reads: ClassVar[re.Pattern] = PLAN_READS
    marks: ClassVar[str] = "GPTQ zeros and group index"
    card_tags: ClassVar[frozenset[str]] = frozenset({"gptq", "auto-gptq", "autogptq", "gptqmodel", "int4", "4-bit"})
    card_fields: ClassVar[str] = r"gptq"

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
        source = " from GPTQ" if several else ""
        return (
            f"Every weight dequantized{source} is bit for bit what GPTQModel's torch kernel (`dequantize_weight`, "
            "the weights transformers' GPTQ layers compute with) gives, v1 zeros converted as it converts them, "
            f"in the scales' dtype, then cast to {dtype_flag} where that differs."
        )
