"""MXFP4 checkpoints (``quant_method: "mxfp4"``: gpt-oss): which tensors they are, their checks, and the arithmetic
that makes the dense expert weights transformers' ``GptOssExperts`` loads, in pieces.

gpt-oss quantizes only its MoE experts' two projections; attention, router, embeddings, head and norms are dense
BF16 (the config's ``modules_to_not_convert``), and so are the experts' biases. Per layer ``L`` and projection
``P`` (``gate_up_proj``, ``down_proj``) of ``model.layers.L.mlp.experts``:

    P_blocks  U8 [E, R, G, 16]   FP4 (E2M1) codes, two per byte, the LOW nibble first: byte b of a 32-value block
                                 holds values 2b (low nibble) and 2b + 1 (high nibble)
    P_scales  U8 [E, R, G]       one E8M0 exponent per 32 values: 2 ** (byte - 127)
    P_bias    BF16 [E, R]        dense, copied as it is

and the dense weight is ``P`` [E, G * 32, R], the transpose of the [E, R, G * 32] rows the blocks hold:
``gate_up_proj`` [E, hidden, 2 * intermediate] (gate and up interleaved, even and odd columns) and ``down_proj``
[E, intermediate, hidden], the parameters of ``GptOssExperts`` (transformers 5.24, ``models/gpt_oss``).

The reference is transformers' ``integrations/mxfp4.py`` ``convert_moe_packed_tensors`` (what
``Mxfp4Config(dequantize=True)`` runs, through ``Mxfp4Dequantize``, in the dtype of the parameter it loads into):
``lut`` = the 16 E2M1 values (+0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated, -0 included) as a tensor of the
output dtype; low nibbles to even columns, high to odd; ``torch.ldexp(values, scale - 127, out=values)``; reshape
and ``transpose(1, 2).contiguous()``. torch's CPU ldexp is the exact ``value * 2 ** e`` rounded once to the output
dtype (E8M0 255 gives 0.5 * 2 ** 128 = 2 ** 127, not NaN; 0 * 2 ** 128 = 0): not ``value * pow(2, e)`` in fp32,
whose 2 ** 128 would be inf.

Here the same value is one fp32 multiply that is exact: the doubled E2M1 value (0, 1, 2, 3, 4, 6, 8 or 12, signed)
times ``2 ** (byte - 128)``, a power of two in fp32's range for every byte (2 ** -128 and 2 ** -127 as subnormals),
its bits built from the byte with integer ops; the product of a value of at most 2 significant bits and a power of
two is exact in fp32 down to 2 ** -149, or overflows to inf exactly when the true value is beyond fp32's range. So
on CPU and CUDA alike (integer ops, one IEEE multiply with gradual underflow, one round-to-nearest-even cast) the
output is the exact value rounded once to the output dtype: bf16 and fp32 hold every value exactly (the same
exponent range; 6 * 2 ** 127 and 12 * 2 ** 127 overflow to inf in both), fp16 rounds to nearest even outside its
range (overflow to inf, underflow to subnormals and zero), as transformers does in fp16. No NaN is ever made.

The MX format calls E8M0 255 NaN; gpt-oss never writes it. :func:`check_scales` refuses it in a piece's scales (the
scales are 1/16 of the blocks: read with each piece, not all at planning).

What each ``--dtype`` is: bf16 (transformers' default) and fp32 are exact, bit for bit transformers'; fp16 is
transformers' fp16.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Iterator

from ..dtypes import DTYPES, OUTPUT_DTYPES
from ..errors import ArgumentError, CheckpointError
from ..safetensors_io.read import TensorInfo
from .base import SourceFormat, register

if TYPE_CHECKING:
    import numpy as np
    import torch

# The E2M1 values times two (so that the scale 2 ** (byte - 128) stays within fp32's normal/subnormal range for
# every byte), index = the nibble: sign bit 3, exponent bits 2-1, mantissa bit 0.
DOUBLED_E2M1 = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, -0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0)
BLOCK_VALUES = 32  # values per E8M0 scale
BLOCK_BYTES = 16
E8M0_NAN = 255
PARTS = ("_blocks", "_scales")
PLAN_READS = re.compile(r"(?!)")  # the plan needs headers only


@dataclass(frozen=True)
class WeightMxfp4:
    """One MXFP4 expert projection: its dense name and the source tensors it is rebuilt from."""

    name: str  # e.g. "model.layers.0.mlp.experts.gate_up_proj"
    blocks: TensorInfo  # U8 [E, R, G, 16]
    scales: TensorInfo  # U8 [E, R, G]

    @property
    def experts(self) -> int:
        return self.blocks.shape[0]

    @property
    def rows(self) -> int:
        """R: the blocks' rows, the dense weight's last dim."""
        return self.blocks.shape[1]

    @property
    def groups(self) -> int:
        return self.blocks.shape[2]

    @property
    def shape(self) -> tuple:
        """The dense weight's shape [E, G * 32, R]."""
        return self.experts, self.groups * BLOCK_VALUES, self.rows

    @property
    def sources(self) -> tuple[TensorInfo, ...]:
        return self.blocks, self.scales

    def pieces(self, max_values: int) -> Iterator[tuple[int, int, int, int]]:
        """(first expert, experts, first group, groups) of pieces of about ``max_values`` dense values at most (at
        least one group of one expert): runs of whole experts where one fits, else runs of whole groups (32 dense
        rows) of one expert. Each piece is a contiguous range of the dense weight's bytes."""
        per_group = BLOCK_VALUES * self.rows
        per_expert = per_group * self.groups
        if per_expert <= max_values or self.groups == 0:
            step = max(1, max_values // max(1, per_expert))
            for first in range(0, self.experts, step):
                yield first, min(step, self.experts - first), 0, self.groups
            return
        step = max(1, max_values // max(1, per_group))
        for expert in range(self.experts):
            for first in range(0, self.groups, step):
                yield expert, 1, first, min(step, self.groups - first)


def find_weights(tensors: dict[str, TensorInfo]) -> list[WeightMxfp4]:
    """Every MXFP4 weight of a checkpoint (from headers alone), checked, in name order. CheckpointError naming the
    file and tensor for blocks without scales or scales without blocks, dtypes other than U8, shapes other than
    [E, R, G, 16] and [E, R, G], or a dense tensor already named as the dequantized weight."""
    # A name ends so in a dense checkpoint too (a float "layer_scales"): a pair is MXFP4 where one of them is bytes.
    names = {
        key[: -len(part)]
        for key, info in tensors.items()
        for part in PARTS
        if key.endswith(part) and info.dtype == "U8"
    }
    found = []
    for name in sorted(names):
        blocks, scales = tensors.get(name + "_blocks"), tensors.get(name + "_scales")
        if blocks is None or scales is None:
            present, missing = (scales, "_blocks") if blocks is None else (blocks, "_scales")
            raise CheckpointError(
                f"{present.path}: tensor '{present.name}' is MXFP4 data but '{name}{missing}' is missing"
            )
        for info in (blocks, scales):
            if info.dtype != "U8":
                raise CheckpointError(f"{info.path}: tensor '{info.name}' (MXFP4) is {info.dtype}, U8 expected")
        at_blocks = f"{blocks.path}: tensor '{blocks.name}'"
        if len(blocks.shape) != 4 or blocks.shape[-1] != BLOCK_BYTES:
            raise CheckpointError(f"{at_blocks} has shape {list(blocks.shape)}, [experts, rows, blocks, 16] expected")
        if tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise CheckpointError(
                f"{scales.path}: tensor '{scales.name}' has shape {list(scales.shape)}, one scale per block of "
                f"'{blocks.name}' {list(blocks.shape)} expected: {list(blocks.shape[:-1])}"
            )
        if name in tensors:
            dense = tensors[name]
            raise CheckpointError(f"{dense.path}: tensor '{name}' is in the checkpoint beside its MXFP4 blocks")
        found.append(WeightMxfp4(name, blocks, scales))
    return found


def check_scales(scales: TensorInfo, values) -> None:
    """CheckpointError if a piece's E8M0 scale bytes (``values``: numpy or torch uint8) hold 255, the MX format's
    NaN, which no writer makes and transformers would read as 2 ** 128."""
    if bool((values == E8M0_NAN).any()):
        raise CheckpointError(f"{scales.path}: tensor '{scales.name}' holds the E8M0 NaN scale (255)")


def is_quantization_key(name: str) -> bool:
    """A tensor only an MXFP4 checkpoint has: a projection's blocks or scales (a dense model may have other
    "..._scales")."""
    return name.endswith(tuple("proj" + part for part in PARTS))


# Scale bytes from which a group's values may pass fp32's range (and bf16's: an FP4 value times a power of two
# overflows both at 2 ** 128): 12 * 2 ** (253 - 128) is 1.5 * 2 ** 128.
OVERFLOWING = 253


def check_range(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    """CheckpointError if a piece's values (``blocks`` [m, R, G, 16], ``scales`` [m, R, G], uint8 on one device)
    include one beyond every output dtype's range (±inf in fp32 and bf16, so in fp16 too): no writer makes them, and
    the dense weight would hold inf. Values beyond fp16's range only are the fp16 warning's (``plan.may_exceed``)."""
    import torch

    if not bool((scales >= OVERFLOWING).any()):
        return
    wide = dequantize(blocks, scales, torch.float32)
    infinite = int((~torch.isfinite(wide)).sum())
    if infinite:
        largest = int(scales.max())
        raise CheckpointError(
            f"tensor '{name}' holds {infinite} values beyond every output dtype's range (scale bytes up to {largest}, "
            f"2 ** {largest - 127} times an FP4 value); the dense weight would hold inf there"
        )


def dequantize(
    blocks: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype, first_group: int = 0, groups: int | None = None
) -> torch.Tensor:
    """The dense rows of experts' MXFP4 weights: ``blocks`` uint8 [m, R, G, 16] and ``scales`` uint8 [m, R, G] (m
    experts, on one device) give groups ``[first_group, first_group + groups)`` of their dense weights,
    [m, groups * 32, R] in ``out_dtype`` (contiguous). Bit for bit ``convert_moe_packed_tensors(blocks, scales,
    dtype=out_dtype)[:, 32 * first_group : 32 * (first_group + groups)]`` (the module docstring says why, and on
    which device)."""
    import torch

    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ArgumentError(f"MXFP4 dequantize takes uint8 blocks and scales, not {blocks.dtype}, {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK_BYTES or scales.shape != blocks.shape[:-1]:
        shapes = f"{list(blocks.shape)} and {list(scales.shape)}"
        raise ArgumentError(f"MXFP4 dequantize takes blocks [m, R, G, 16] and scales [m, R, G], not {shapes}")
    if out_dtype not in tuple(dtype.torch for dtype in OUTPUT_DTYPES.values()):
        raise ArgumentError(f"MXFP4 dequantize writes float16, bfloat16 or float32, not {out_dtype}")
    if blocks.device != scales.device:
        raise ArgumentError(f"MXFP4 dequantize: blocks on {blocks.device}, scales on {scales.device}")
    experts, rows, total, _ = blocks.shape
    groups = total - first_group if groups is None else groups
    if not 0 <= first_group <= first_group + groups <= total:
        raise ArgumentError(f"MXFP4 dequantize: groups {first_group}..+{groups} of {total}")
    blocks = blocks[:, :, first_group : first_group + groups]
    scales = scales[:, :, first_group : first_group + groups]
    # Each byte's two values (low nibble first) from a table of the 256 bytes: one gather of whole pairs, which is
    # several times faster on a CPU than a gather per nibble.
    table = torch.tensor(DOUBLED_E2M1, dtype=torch.float32, device=blocks.device)
    every = torch.arange(256, device=blocks.device)
    pairs = torch.stack((table[every & 0x0F], table[every >> 4]), dim=1)
    values = pairs.index_select(0, blocks.reshape(-1).to(torch.int32))
    values = values.view(experts, rows, groups, BLOCK_BYTES, 2)
    # 2 ** (byte - 128) as fp32 bits: a normal number's exponent field for bytes 2..255, the subnormals 2 ** -127
    # (0x00400000) and 2 ** -128 (0x00200000) for bytes 1 and 0.
    byte = scales.to(torch.int32)
    bits = torch.where(byte >= 2, (byte - 1) << 23, torch.full_like(byte, 0x00200000) << byte)
    values.mul_(bits.view(torch.float32)[..., None, None])
    dense = values.view(experts, rows, groups * BLOCK_VALUES).transpose(1, 2)
    return dense.to(out_dtype).contiguous() if out_dtype != torch.float32 else dense.contiguous()


def host(
    read: np.ndarray,
    out: np.ndarray,
    *,
    scales: np.ndarray,
    rows: int,
    total_groups: int,
    first_group: int,
    groups: int,
    out_code: str,
) -> None:
    """The CPU route's piece: ``read`` is the uint8 blocks of whole experts, ``scales`` their uint8 scales, ``out``
    the output bytes of groups ``[first_group, first_group + groups)`` of those experts' dense weights, written in
    place with :func:`dequantize`'s bytes (the same torch ops on the CPU)."""
    import torch

    experts = read.size // max(1, rows * total_groups * BLOCK_BYTES)
    blocks = torch.from_numpy(read).view(experts, rows, total_groups, BLOCK_BYTES)
    scale = torch.from_numpy(scales).view(experts, rows, total_groups)
    dense = dequantize(blocks, scale, DTYPES[out_code].torch, first_group, groups)
    torch.from_numpy(out).copy_(dense.reshape(-1).view(torch.uint8))


def output_bytes(weight: WeightMxfp4, piece: tuple[int, int, int, int], itemsize: int) -> tuple[int, int]:
    """(offset, nbytes) of a piece (from :meth:`WeightMxfp4.pieces`) in the dense weight's bytes."""
    first_expert, experts, first_group, groups = piece
    first = (first_expert * weight.groups + first_group) * BLOCK_VALUES * weight.rows
    return first * itemsize, experts * groups * BLOCK_VALUES * weight.rows * itemsize


def source_bytes(weight: WeightMxfp4, piece: tuple[int, int, int, int]) -> tuple[int, int]:
    """(first byte, count) of the blocks a piece reads: its whole experts."""
    per_expert = weight.rows * weight.groups * BLOCK_BYTES
    return piece[0] * per_expert, piece[1] * per_expert


@register
class Mxfp4Format(SourceFormat):
    """``quant_method: "mxfp4"`` checkpoints: gpt-oss's MXFP4 experts."""

    name: ClassVar[str] = "mxfp4"
    family: ClassVar[str] = "MXFP4"
    title: ClassVar[str] = "MXFP4 (OCP microscaling FP4)"
    quant_methods: ClassVar[tuple[str, ...]] = ("mxfp4",)
    name_suffix: ClassVar[str] = r"mxfp4"
    plan_reads: ClassVar[re.Pattern] = PLAN_READS
    marks: ClassVar[str] = "MXFP4 blocks"
    card_tags: ClassVar[frozenset[str]] = frozenset({"mxfp4"})

    @classmethod
    def is_quantization_key(cls, tensor_name: str) -> bool:
        return is_quantization_key(tensor_name)

    @classmethod
    def exactness(cls, dtype_flag: str, several: bool) -> str:
        source = " from MXFP4" if several else ""
        if dtype_flag in ("bf16", "fp32"):
            return (
                f"Every expert weight dequantized{source} is its FP4 value times its block's power of two, exact in "
                f"{dtype_flag}: bit for bit transformers' `Mxfp4Config(dequantize=True)`."
            )
        return (
            f"Every expert weight dequantized{source} is its FP4 value times its block's power of two rounded to "
            "fp16 (beyond its range to inf, tiny values to its subnormals): bit for bit transformers' "
            "`Mxfp4Config(dequantize=True)` in fp16."
        )
