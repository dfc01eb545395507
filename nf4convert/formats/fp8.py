"""FP8 checkpoints (``quant_method: "fp8"``: DeepSeek V3/R1, Qwen3-*-FP8, transformers' ``FineGrainedFP8Config``):
which tensors they are, their checks, and the arithmetic that makes the dense weight, in pieces.

A linear layer ``X`` of such a checkpoint holds:

    X.weight            F8_E4M3 [..., n, k]   the codes
    X.weight_scale_inv  F32/BF16/F16/F8_E8M0  what each code is multiplied by (the "inverse" of the quantization
                                              scale): [..., ceil(n / bm), ceil(k / bn)] for the config's
                                              ``weight_block_size: [bm, bn]``, one value ([] or [1]) without it
    X.activation_scale / X.input_scale        static activation scales: nothing a dense weight needs (dropped)

DeepSeek V3/R1 write F32 scales, Qwen3-*-FP8 BF16 (some F16). ``weight_scale`` is the name vLLM-style FP8 writers
give the same multiplier; both names are read (never both for one weight). Modules in ``modules_to_not_convert``
(alias ``ignored_layers``) are dense and not ours. ``scale_fmt: "ue8m0"`` (DeepSeek-V3.1 and later) says every
scale is a power of two: stored as F8_E8M0 bytes (or U8, as transformers views them) or as F32/BF16/F16 powers of
two, each checked (``e8m0.py`` says which releases store which). DeepSeek-V4's ``X.scale`` (F8_E8M0) is read here
where ``X.weight`` is F8; its FP4 experts (an I8 ``X.weight`` beside ``X.scale``) are ``deepseek_fp4.py``'s.

The arithmetic, as each reference does it:

- DeepSeek's ``inference/kernel.py`` ``weight_dequant`` (used by ``fp8_cast_bf16.py``): a Triton kernel over
  128 x 128 tiles, ``y = x.to(fp32) * s`` with ``s`` the tile's scale (``s[pid_m * cdiv(N, 128) + pid_n]``), masked
  at the edges, stored into a tensor of torch's default dtype (bf16 in ``fp8_cast_bf16.py``): round to nearest
  even. Ragged edges are right: the last row/column of tiles is partial and still uses its own scale.
- compressed-tensors' ``FP8BlockDequantizer`` (``entrypoints/convert/converters/fp8block_dequantizer.py``, 0.20):
  pads the weight to whole blocks, ``(weight.to(fp32) * weight_scale_inv.to(fp32)).to(dtype)``, cuts the padding
  off: the same values as DeepSeek's, for any block size.
- transformers' ``Fp8Dequantize._dequantize_one`` (``integrations/finegrained_fp8.py``, 5.24, what
  ``FineGrainedFP8Config(dequantize=True)`` runs): ``(w.to(fp32) * s.to(fp32)).to(dtype)`` per block, but the block
  is *derived from the scale grid* (``n // scale_rows``), not read from the config. Where ``n`` or ``k`` is not a
  multiple of the block this refuses (``ValueError: ... not divisible by scale grid``, e.g. DeepSeek V3's
  ``kv_a_proj_with_mqa`` [576, 7168] with scales [5, 56]) or, where the grid happens to divide, silently uses the
  wrong blocks (a [200, 300] weight with 128-blocks: 2 x 3 scales read as 100 x 100 blocks). Here the config's
  block is used, as DeepSeek's and compressed-tensors' code does; on shapes that are whole blocks all three agree.

So, per element, with ``s`` the scale of the block holding it:

    out = round_T( fl32( fp32(code) * fp32(s) ) )

Why the bytes are the same on CPU and CUDA, op by op: F8 -> fp32 is exact (every E4M3/E5M2 value is an fp32
value; both devices run c10's one conversion function); BF16/F16/F32 -> fp32 is exact; the product is one IEEE
fp32 multiply, correctly rounded to nearest even with gradual underflow on both (torch builds without fast-math or
flush-to-zero; eager mode launches one kernel per op, so nothing is fused into an FMA), in place on the fp32 copy
(the same rounding as out of place); the cast to fp16/bf16 rounds to nearest even on both. The one exception is
NaN's bits: the codes 0x7f/0xff are NaN, and NaN bits differ by device (x86 keeps the payload and its
fp32 -> bf16 cast makes 0x7fc0; CUDA makes 0x7fff...), so a CPU and a GPU result agree there only as NaN; on one
device ours and the reference's agree bit for bit. No writer makes these codes.

What each ``--dtype`` is, bit for bit:

- fp32: the fp32 product. With E8M0 (power-of-two) scales it is exact but where it falls below fp32's normal range;
  with BF16/F16 scales the exact product (4 + 8 or 4 + 11 significant bits fit fp32's 24); with F32 scales the fp32
  product every reference computes. (compressed-tensors FP8 rounds it to a BF16/F16 scale's dtype first.)
- bf16: that product rounded to bf16: DeepSeek's ``fp8_cast_bf16.py``, compressed-tensors' ``FP8BlockDequantizer``
  and transformers' ``dequantize=True`` in bf16 (on whole-block shapes) give these bytes.
- fp16: that product rounded to fp16 (transformers with ``dtype=torch.float16``; inf beyond 65504).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Iterator

from ..dtypes import DTYPES, OUTPUT_DTYPES
from ..errors import ArgumentError, CheckpointError
from ..safetensors_io.read import TensorInfo
from . import e8m0
from .base import SourceFormat, register

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ..safetensors_io.read import TensorReader

FP8_CODES = ("F8_E4M3", "F8_E5M2")
SCALE_CODES = ("F32", "BF16", "F16")
SCALE_NAMES = ("weight_scale_inv", "weight_scale")
BARE_SCALE = "scale"  # DeepSeek-V4's name for an FP8 weight's scale (read where the weight beside it is F8)
# Static activation and KV-cache scales: a dense model does not need them, and no output keeps them.
ACTIVATION_NAMES = ("activation_scale", "input_scale", "k_scale", "v_scale")
PLAN_READS = re.compile(r"\.(?:weight_scale_inv|weight_scale|scale)$")


@dataclass(frozen=True)
class Grid:
    """How a weight's rows and columns map onto its scales, in the weight's 2-D view ``[rows, columns]`` (the
    leading dims of a stacked weight folded into rows): each matrix of ``matrix_rows`` rows has its own
    ``ceil(matrix_rows / block_rows)`` rows of scales, each scale covering ``block_rows`` x ``block_columns``
    codes (the last row and column of blocks partial). One scale for the whole tensor is the block of the whole
    tensor; one per row (compressed-tensors' channel strategy) is ``block_rows = 1, block_columns = columns``."""

    rows: int
    columns: int
    matrix_rows: int
    block_rows: int
    block_columns: int

    @property
    def matrix_scale_rows(self) -> int:
        return -(-self.matrix_rows // self.block_rows)

    @property
    def scale_columns(self) -> int:
        return -(-self.columns // self.block_columns)

    @property
    def scale_rows(self) -> int:
        return (self.rows // self.matrix_rows) * self.matrix_scale_rows if self.rows else 0

    def scale_row(self, row: int) -> int:
        """The scale row of weight row ``row``."""
        return (row // self.matrix_rows) * self.matrix_scale_rows + (row % self.matrix_rows) // self.block_rows

    def scale_span(self, first: int, count: int) -> tuple[int, int]:
        """(first scale row, number of scale rows) that weight rows ``[first, first + count)`` use."""
        if count == 0:
            return 0, 0
        begin = self.scale_row(first)
        return begin, self.scale_row(first + count - 1) + 1 - begin

    def pieces(self, max_rows: int) -> Iterator[tuple[int, int]]:
        """(first row, count) of pieces of at most ``max_rows`` rows (at least one): runs of whole matrices, or runs
        of whole block rows of one matrix where a block row fits, so that no two pieces share a scale row."""
        step = max(1, max_rows)
        first = 0
        while first < self.rows:
            if first % self.matrix_rows == 0 and step >= self.matrix_rows:
                end = first + step // self.matrix_rows * self.matrix_rows
            else:
                unit = self.block_rows if step >= self.block_rows else 1
                end = min(first + step // unit * unit, (first // self.matrix_rows + 1) * self.matrix_rows)
            end = min(end, self.rows)
            yield first, end - first
            first = end


@dataclass(frozen=True)
class WeightFp8:
    """One FP8 weight: its output name, its codes and scales, and how they map (``grid``)."""

    name: str  # the dense weight's name, e.g. "model.layers.0.mlp.up_proj.weight"
    weight: TensorInfo  # F8 [..., n, k]
    scale: TensorInfo  # F32/BF16/F16, the grid's scales
    grid: Grid
    format: str = "fp8"  # the format it was found by ("fp8", "compressed-tensors")
    strategy: str = "block"  # "block", "tensor", "channel": how its scales were laid out
    args: tuple = ()  # compressed-tensors: the weights' QuantizationArgs as sorted (key, value) pairs

    @property
    def shape(self) -> tuple:
        return self.weight.shape

    @property
    def block(self) -> tuple[int, int]:
        return self.grid.block_rows, self.grid.block_columns

    @property
    def sources(self) -> tuple[TensorInfo, ...]:
        return self.weight, self.scale


def block_size(quantization: dict) -> tuple[int, int] | None:
    """The config's ``weight_block_size`` as (rows, columns), None for one scale per tensor (a malformed value is
    :func:`config_problem`'s to report, before this is asked)."""
    value = quantization.get("weight_block_size")
    if value is None:
        return None
    return int(value[0]), int(value[1])


def ue8m0(quantization: dict) -> bool:
    """Whether the config says each scale is a power of two (``scale_fmt: "ue8m0"``)."""
    return quantization.get("scale_fmt") == "ue8m0"


def config_problem(quantization: dict) -> str | None:
    """What in an ``fp8`` quantization_config cannot be read, or None."""
    value = quantization.get("weight_block_size")
    if value is not None and not (
        isinstance(value, (list, tuple)) and len(value) == 2 and all(type(size) is int and size > 0 for size in value)  # noqa: E721  (bool is an int: refused)
    ):
        return f"weight_block_size {value!r} is not two positive integers"
    if quantization.get("scale_fmt", "float") not in ("float", "ue8m0", None):
        return f"scale_fmt {quantization.get('scale_fmt')!r} is not 'float' or 'ue8m0'"
    if quantization.get("expert_dtype", "fp8") not in ("fp8", "fp4", None):
        return f"expert_dtype {quantization.get('expert_dtype')!r} is not read (FP8 or FP4 experts are)"
    return None


def find_weights(
    tensors: dict[str, TensorInfo], reader: TensorReader, block: tuple[int, int] | None, powers: bool = False
) -> list[WeightFp8]:
    """Every FP8 weight of a checkpoint whose quantization_config is ``fp8`` with ``block`` (the config's
    ``weight_block_size``, None: one scale per tensor), checked, in name order.

    ``tensors`` is the whole checkpoint (a weight and its scale may be in different shards); the scales (one value
    per block) are read through ``reader`` to refuse NaN or infinite ones. CheckpointError, naming the file and
    tensor, for an F8 tensor without its scale, a scale without its weight, both scale names for one weight, a
    scale of the wrong dtype or shape (the config's blocks do not tile the weight as stored), NaN or inf scales.
    ``powers`` (the config's ``scale_fmt: "ue8m0"``): one-byte E8M0 scales may be U8 too, and every scale must be a
    power of two (no E8M0 NaN byte)."""
    found = []
    codes = (*SCALE_CODES, *e8m0.BYTE_CODES) if powers else SCALE_CODES
    for prefix, weight, scale in pairs(tensors, (*SCALE_NAMES, BARE_SCALE), codes):
        name = prefix + "weight"
        grid = _block_grid(weight, scale, block) if block is not None else _tensor_grid(weight, scale)
        if powers or scale.dtype in e8m0.BYTE_CODES:
            e8m0.check(scale, reader)
        else:
            check_finite(scale, reader)
        found.append(WeightFp8(name, weight, scale, grid, "fp8", "block" if block is not None else "tensor"))
    return found


def pairs(
    tensors: dict[str, TensorInfo], names: tuple[str, ...] = SCALE_NAMES, codes: tuple[str, ...] = SCALE_CODES
) -> Iterator[tuple[str, TensorInfo, TensorInfo]]:
    """(prefix, weight, scale) of each FP8 weight, its scale named one of ``names`` and of a dtype in ``codes``;
    their names and dtypes checked, unpaired ones refused."""
    prefixes = {
        key[: -len(part)]
        for key in tensors
        for part in names
        if key.endswith("." + part) and (part != BARE_SCALE or _codes_beside(tensors, key[: -len(part)]))
    }
    for key, info in tensors.items():
        if info.dtype in FP8_CODES and key.endswith(".weight") and key[: -len("weight")] not in prefixes:
            raise CheckpointError(
                f"{info.path}: tensor '{key}' is {info.dtype} without its scale "
                f"'{key[: -len('weight')]}{names[0]}'{' (or ' + repr(names[1]) + ')' if len(names) > 1 else ''}: "
                "not in the checkpoint"
            )
        if info.dtype in FP8_CODES and not key.endswith(".weight"):
            raise CheckpointError(f"{info.path}: tensor '{key}' is {info.dtype} but is no layer's weight")
    for prefix in sorted(prefixes):
        scales = [tensors[prefix + part] for part in names if prefix + part in tensors]
        scale = scales[0]
        if len(scales) > 1:
            raise CheckpointError(
                f"{scale.path}: tensor '{scale.name}' and '{scales[1].name}' both scale '{prefix}weight'"
            )
        weight = tensors.get(prefix + "weight")
        if weight is None:
            raise CheckpointError(
                f"{scale.path}: tensor '{scale.name}' is an FP8 scale but its weight '{prefix}weight' is missing"
            )
        at_weight = f"{weight.path}: tensor '{weight.name}'"
        if weight.dtype not in FP8_CODES:
            raise CheckpointError(f"{at_weight} has an FP8 scale ('{scale.name}') but is {weight.dtype}, not F8_E4M3")
        if len(weight.shape) < 2:
            raise CheckpointError(
                f"{at_weight} is an FP8 weight of shape {list(weight.shape)}, [..., out, in] expected"
            )
        if scale.dtype not in codes:
            raise CheckpointError(
                f"{scale.path}: tensor '{scale.name}' (FP8 scales) is {scale.dtype}, not one of {', '.join(codes)}"
            )
        yield prefix, weight, scale


def _codes_beside(tensors: dict[str, TensorInfo], prefix: str) -> bool:
    """Whether ``prefix + "weight"`` is an F8 weight (a bare ``scale`` beside it is its FP8 scale)."""
    weight = tensors.get(prefix + "weight")
    return weight is not None and weight.dtype in FP8_CODES


def _block_grid(weight: TensorInfo, scale: TensorInfo, block: tuple[int, int]) -> Grid:
    *lead, rows, columns = weight.shape
    block_rows, block_columns = block
    expected = [*lead, -(-rows // block_rows), -(-columns // block_columns)]
    if list(scale.shape) != expected:
        raise CheckpointError(
            f"{scale.path}: tensor '{scale.name}' has shape {list(scale.shape)}, but blocks of "
            f"{block_rows} x {block_columns} (weight_block_size) tile '{weight.name}' {list(weight.shape)} "
            f"into {expected}"
        )
    return Grid(math.prod(lead) * rows, columns, rows, block_rows, block_columns)


def _tensor_grid(weight: TensorInfo, scale: TensorInfo) -> Grid:
    if math.prod(scale.shape) != 1 or len(scale.shape) > 1:
        raise CheckpointError(
            f"{scale.path}: tensor '{scale.name}' has shape {list(scale.shape)}; without weight_block_size in the "
            f"quantization_config one scale ([] or [1]) per weight is expected"
        )
    *lead, rows, columns = weight.shape
    whole = max(1, math.prod(lead) * rows)
    return Grid(math.prod(lead) * rows, columns, whole, whole, max(1, columns))


def check_finite(scale: TensorInfo, reader: TensorReader) -> None:
    """CheckpointError if a scale tensor holds NaN or inf: every code of its blocks would be NaN or inf (with bits
    that differ by device). Scales are one value per block: cheap to read."""
    values = reader.tensor(scale)
    if not bool(values.isfinite().all()):
        raise CheckpointError(f"{scale.path}: tensor '{scale.name}' holds a NaN or infinite scale")


def unconfigured(tensors: dict[str, TensorInfo]) -> None:
    """CheckpointError for an FP8 weight beside its scale in a checkpoint whose config.json says no FP8: the blocks
    its scales cover are the config's ``weight_block_size`` to say (copied as they are, the codes would be written as
    a "dense" FP8 weight)."""
    for key, info in tensors.items():
        scales = [key.removesuffix("weight") + name for name in SCALE_NAMES]
        if info.dtype in FP8_CODES and key.endswith(".weight") and any(scale in tensors for scale in scales):
            raise CheckpointError(
                f"{info.path}: tensor '{key}' is {info.dtype} with scales, but config.json has no FP8 "
                "quantization_config (quant_method 'fp8' or compressed-tensors) to say their blocks"
            )


def is_quantization_key(name: str) -> bool:
    """A tensor only an FP8 checkpoint has (its scales)."""
    return name.rsplit(".", 1)[-1] in (*SCALE_NAMES, *ACTIVATION_NAMES)


def dequantize(
    codes: torch.Tensor, scales: torch.Tensor, grid: Grid, first_row: int, out_dtype: torch.dtype, through=None
) -> torch.Tensor:
    """Rows ``[first_row, first_row + len(codes))`` of an FP8 weight, dense in ``out_dtype``.

    ``codes`` is those rows ([rows, columns], float8 e4m3/e5m2), ``scales`` the scale rows they use
    (``grid.scale_span(first_row, rows)``: [scale rows, scale columns], float32/bfloat16/float16, or E8M0 bytes as
    float8_e8m0fnu/uint8; any shape with those elements), on the same device. Bit for bit ``(codes.to(fp32) *
    scale.to(fp32)).to(out_dtype)`` with each element's own block scale, on CPU and CUDA alike (the module docstring
    says why); ``through`` (bf16 or fp16, the dtype compressed-tensors multiplies in): rounded to it first."""
    import torch

    if e8m0.is_bytes(scales):
        scales = e8m0.values(scales)
    if codes.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or scales.dtype not in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ):
        raise ArgumentError(f"FP8 dequantize takes float8 codes and float scales, not {codes.dtype}, {scales.dtype}")
    if out_dtype not in tuple(dtype.torch for dtype in OUTPUT_DTYPES.values()):
        raise ArgumentError(f"FP8 dequantize writes float16, bfloat16 or float32, not {out_dtype}")
    rows, columns = codes.shape
    first_scale, scale_rows = grid.scale_span(first_row, rows)
    if columns != grid.columns or scales.numel() != scale_rows * grid.scale_columns:
        raise ArgumentError(
            f"FP8 dequantize: codes {list(codes.shape)} and {scales.numel()} scales do not fit rows "
            f"{first_row}.. of a grid {grid}"
        )
    if codes.device != scales.device:
        raise ArgumentError(f"FP8 dequantize: codes on {codes.device}, scales on {scales.device}")
    # Each code's fp32 value from a table of the 256 codes made by torch's own conversion (so the same bits as
    # ``codes.to(fp32)``, NaNs included): a gather, several times faster than that conversion on a CPU.
    table = torch.arange(256, dtype=torch.uint8, device=codes.device).view(codes.dtype).to(torch.float32)
    values = table.index_select(0, codes.view(torch.uint8).reshape(-1).to(torch.int32)).view(rows, columns)
    if rows == 0 or columns == 0:
        return values.to(out_dtype)
    scale = scales.reshape(scale_rows, grid.scale_columns).to(torch.float32)
    # Each row's scale row, gathered: rows x scale-columns values, a block's worth smaller than the weight.
    row = torch.arange(first_row, first_row + rows, device=codes.device)
    index = (row // grid.matrix_rows) * grid.matrix_scale_rows + (row % grid.matrix_rows) // grid.block_rows
    row_scales = scale[index - first_scale]
    whole, rest = divmod(columns, grid.block_columns)
    if whole:  # a view of the whole blocks' columns, each block's codes times its one scale, in place
        values[:, : whole * grid.block_columns].unflatten(-1, (whole, grid.block_columns)).mul_(
            row_scales[:, :whole, None]
        )
    if rest:  # the partial last column of blocks
        values[:, whole * grid.block_columns :].mul_(row_scales[:, whole:])
    return (values.to(through) if through not in (None, torch.float32) else values).to(out_dtype)  # no copy if same


# The codes no writer stores, as (mask, value) of the byte: E4M3's NaN (0x7f, 0xff), E5M2's infinities and NaNs.
NOT_FINITE = {"F8_E4M3": (0x7F, 0x7F), "F8_E5M2": (0x7C, 0x7C)}


def check_codes(codes, code: str, name: str) -> None:
    """CheckpointError if an FP8 weight's codes (bytes: a numpy or torch uint8 array, on any device) hold a NaN or
    infinite code: no writer stores one, and its NaN bits differ by device. Checked as each piece is made (a plan
    reads no codes, so a dry run does not see it)."""
    mask, value = NOT_FINITE[code]
    found = (codes & mask) == value
    if bool(found.any()):
        raise CheckpointError(
            f"tensor '{name}' holds {int(found.sum())} {code} NaN or infinite codes (byte 0x{value:02x} or "
            f"0x{value | 0x80:02x}); an FP8 writer stores none, and the dense weight would hold NaN there"
        )


def host(
    read: np.ndarray,
    out: np.ndarray,
    *,
    scales: np.ndarray,
    scale_code: str,
    code: str,
    grid: Grid,
    first_row: int,
    out_code: str,
    name: str = "",
    through_code=None,
) -> None:
    """The CPU route's piece: ``read`` its codes (uint8 bytes of whole rows from ``first_row``), ``scales`` the uint8
    bytes of the scale rows they use, ``out`` its output bytes, written with :func:`dequantize`'s (the same ops)."""
    import torch

    check_codes(read, code, name)
    rows = read.size // max(1, grid.columns)
    codes = torch.from_numpy(read).view(DTYPES[code].torch).reshape(rows, grid.columns)
    scale, through = torch.from_numpy(scales).view(DTYPES[scale_code].torch), through_code and DTYPES[through_code]
    dense = dequantize(codes, scale, grid, first_row, DTYPES[out_code].torch, through and through.torch)
    torch.from_numpy(out).copy_(dense.reshape(-1).view(torch.uint8))


@register
class Fp8Format(SourceFormat):
    """``quant_method: "fp8"`` checkpoints (DeepSeek V3/R1, Qwen3-*-FP8, transformers' ``FineGrainedFP8Config``)."""

    name: ClassVar[str] = "fp8"
    family: ClassVar[str] = "FP8"
    title: ClassVar[str] = "FP8 (e4m3, block scales)"
    quant_methods: ClassVar[tuple[str, ...]] = ("fp8",)
    name_suffix: ClassVar[str] = r"fp8(?:[-_](?:dynamic|block|static))?"
    plan_reads: ClassVar[re.Pattern] = PLAN_READS
    marks: ClassVar[str] = "an FP8 scale"
    card_tags: ClassVar[frozenset[str]] = frozenset({"fp8", "fp8-dynamic", "fp8-block", "fp8-static"})
    card_fields: ClassVar[str] = r"^weight_block_size$|^activation_scheme$"

    @classmethod
    def config_problem(cls, quantization_config: dict) -> str | None:
        return config_problem(quantization_config)

    @classmethod
    def is_quantization_key(cls, tensor_name: str) -> bool:
        return is_quantization_key(tensor_name)

    @classmethod
    def exactness(cls, dtype_flag: str, several: bool) -> str:
        source = " from FP8" if several else ""
        if dtype_flag == "fp32":
            return (
                f"Every weight dequantized{source} is its e4m3 code times its block's scale as one fp32 multiply "
                "(exact where the scales are bf16 or fp16), bit for bit what DeepSeek's `weight_dequant` and "
                "compressed-tensors' `FP8BlockDequantizer` compute before they round."
            )
        return (
            f"Every weight dequantized{source} is its e4m3 code times its block's scale in fp32, rounded once to "
            f"{dtype_flag}: bit for bit what DeepSeek's `fp8_cast_bf16.py` and compressed-tensors' "
            "`FP8BlockDequantizer` make (and transformers' `FineGrainedFP8Config(dequantize=True)` where the weight "
            "is whole blocks: it takes the block from the scale grid, which mis-reads a ragged edge)."
        )
