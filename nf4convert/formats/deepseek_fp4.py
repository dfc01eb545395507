"""DeepSeek-V4's FP4 experts (DeepSeek-V4-Flash / -Pro: ``quant_method: "fp8"`` with ``scale_fmt: "ue8m0"``, and
``expert_dtype: "fp4"`` in config.json): which tensors they are, their checks, and the arithmetic of their dense rows.
The checkpoint's other quantized weights are block FP8 with E8M0 scales (``fp8.py``, which reads their ``X.scale``).

Each routed expert's projection ``layers.L.ffn.experts.E.wN`` (and the MTP layers' ``mtp.M.ffn.experts.E.wN``), one
tensor per expert, not gpt-oss's fused layout (``mxfp4.py``):

    X.weight  I8 [out, in / 2]        two E2M1 codes a byte, the LOW nibble first (bit 3 the sign)
    X.scale   F8_E8M0 [out, in / 32]  one power of two per 32 values of a row: ``2 ** (byte - 127)``, 255 NaN

The maker's ``inference/model.py`` keeps them as ``float4_e2m1fn_x2`` weights with a ``float8_e8m0fnu`` scale per
(1, 32) block, and its ``inference/convert.py`` (``cast_e2m1fn_to_e4m3fn``, for ``--expert-dtype fp8``) decodes them
with ``FP4_TABLE`` (``x & 0x0F`` then ``x >> 4``), which holds +0.0 for nibble 8, before re-scaling to FP8.
transformers' ``Fp8Dequantize`` (``integrations/finegrained_fp8.py``, 5.25: ``_unpack_fp4`` and ``_dequantize_one``,
what ``FineGrainedFP8Config(dequantize=True)`` runs for these experts) decodes them the same way with a table holding
-0.0 for nibble 8, multiplies by the scale in fp32 and casts: the two agree but for the sign of a zero. This follows
transformers (the dense model's loader, and verify's reference):

    out = round_T( fp32(e2m1) * 2 ** (byte - 127) )

a power-of-two multiple of a two-significant-bit value: exact in fp32 and bf16 wherever it is in range (beyond fp32's
range it is inf, below it a subnormal or zero, as torch's multiply makes them); fp16 rounds as transformers' fp16
load does. CPU and CUDA agree bit for bit (table lookups, one exact multiply, one cast).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..dtypes import DTYPES, OUTPUT_DTYPES
from ..errors import ArgumentError, CheckpointError
from ..safetensors_io.read import TensorInfo
from . import e8m0, fp8
from .base import SourceFormat, register

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ..safetensors_io.read import TensorReader

GROUP = 32  # values per E8M0 scale
# transformers' Fp8Dequantize._FP4_E2M1_LUT (index: the nibble)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PLAN_READS = re.compile(r"\.scale$")


@dataclass(frozen=True)
class WeightFp4:
    """One FP4 expert projection: its output name and its two tensors."""

    name: str  # "layers.L.ffn.experts.E.w1.weight", the dense weight keeps the checkpoint's name
    packed: TensorInfo  # I8 [out, in / 2]
    scale: TensorInfo  # F8_E8M0 (or U8) [out, in / 32]

    @property
    def shape(self) -> tuple:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    @property
    def sources(self) -> tuple[TensorInfo, ...]:
        return self.packed, self.scale

    @property
    def groups(self) -> int:
        return self.shape[1] // GROUP


def find_weights(tensors: dict[str, TensorInfo], reader: TensorReader) -> list[WeightFp4]:
    """Every FP4 weight (an I8 ``X.weight`` beside its ``X.scale``) of an ``fp8`` checkpoint, checked, in name order.
    CheckpointError naming the tensor for packed codes that are not 2-D or not whole groups of 32, a scale of the
    wrong dtype or shape, or one holding the E8M0 NaN byte."""
    found = []
    for key in sorted(tensors):
        packed = tensors[key]
        prefix = key[: -len("weight")]
        scale = tensors.get(prefix + "scale")
        if packed.dtype != "I8" or not key.endswith(".weight") or scale is None:
            continue
        if len(packed.shape) != 2 or (packed.shape[1] * 2) % GROUP:
            raise CheckpointError(
                f"{packed.path}: tensor '{key}' is I8 {list(packed.shape)} beside '{scale.name}'; FP4 experts are "
                f"I8 [out, in / 2] with in a multiple of {GROUP}"
            )
        rows, columns = packed.shape[0], packed.shape[1] * 2
        if scale.dtype not in e8m0.BYTE_CODES or list(scale.shape) != [rows, columns // GROUP]:
            raise CheckpointError(
                f"{scale.path}: tensor '{scale.name}' is {scale.dtype} {list(scale.shape)}, but '{key}' "
                f"{list(packed.shape)} takes F8_E8M0 [{rows}, {columns // GROUP}] (one scale per {GROUP} values)"
            )
        e8m0.check(scale, reader)
        found.append(WeightFp4(key, packed, scale))
    return found


def dequantize(packed: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Rows of an FP4 expert weight, dense in ``out_dtype``: ``packed`` its bytes (int8 or uint8) [rows, in / 2],
    ``scales`` their E8M0 scales (float8_e8m0fnu or uint8) [rows, in / 32], on one device. Bit for bit the module
    docstring's formula on CPU and CUDA alike."""
    import torch

    if packed.dtype not in (torch.int8, torch.uint8) or out_dtype not in tuple(d.torch for d in OUTPUT_DTYPES.values()):
        raise ArgumentError(f"FP4 dequantize takes int8 codes into fp16/bf16/fp32, not {packed.dtype}, {out_dtype}")
    rows, half = packed.shape
    groups = half * 2 // GROUP
    if scales.numel() != rows * groups or packed.device != scales.device:
        raise ArgumentError(f"FP4 dequantize: codes {list(packed.shape)} and scales {list(scales.shape)} differ")
    codes = packed.view(torch.uint8)
    table = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    nibbles = torch.stack((codes & 0x0F, codes >> 4), dim=-1).reshape(-1).to(torch.int32)
    values = table.index_select(0, nibbles).view(rows, groups, GROUP)
    values.mul_(e8m0.values(scales).reshape(rows, groups)[..., None])
    values = values.view(rows, groups * GROUP)
    return values if out_dtype == torch.float32 else values.to(out_dtype)


def host(read: np.ndarray, out: np.ndarray, *, scales: np.ndarray, out_code: str) -> None:
    """The CPU route's piece: ``read`` its rows' packed bytes, ``scales`` their scale bytes [rows, groups] (numpy
    uint8), ``out`` the piece's output bytes, written in place with :func:`dequantize`'s bytes."""
    import torch

    rows = scales.shape[0]
    packed = torch.from_numpy(read).view(rows, -1)
    dense = dequantize(packed, torch.from_numpy(scales), DTYPES[out_code].torch)
    torch.from_numpy(out).copy_(dense.reshape(-1).view(torch.uint8))


@register
class DeepseekFp4Format(SourceFormat):
    """DeepSeek-V4's FP4 routed experts, in an ``fp8`` checkpoint beside its block-FP8 weights."""

    name: ClassVar[str] = "deepseek-v4-fp4"
    family: ClassVar[str] = "FP8"  # its checkpoints are FP8 ones (quant_method "fp8")
    title: ClassVar[str] = "DeepSeek-V4 FP4 experts (e2m1, E8M0 scales per 32)"
    quant_methods: ClassVar[tuple[str, ...]] = ("fp8",)
    name_suffix: ClassVar[str] = r"fp8"  # its checkpoints are FP8 ones (DeepSeek-V4-Flash carries no suffix)
    plan_reads: ClassVar[re.Pattern] = PLAN_READS
    marks: ClassVar[str] = "a DeepSeek-V4 FP4 scale"

    @classmethod
    def config_problem(cls, quantization_config: dict) -> str | None:
        return fp8.config_problem(quantization_config)  # the FP8 config its checkpoints share

    @classmethod
    def is_quantization_key(cls, tensor_name: str) -> bool:
        return False  # its scales are named ".scale", as many models' own parameters are

    @classmethod
    def exactness(cls, dtype_flag: str, several: bool) -> str:
        return (
            "Every FP4 expert weight is its E2M1 value times its group's power-of-two E8M0 scale, exact in fp32, "
            f"rounded once to {dtype_flag}: bit for bit transformers' `FineGrainedFP8Config(dequantize=True)` "
            "(DeepSeek's convert.py decodes the same values, +0.0 where transformers has -0.0)."
        )
