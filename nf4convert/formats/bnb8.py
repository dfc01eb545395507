"""bitsandbytes 8-bit (LLM.int8) checkpoints: which tensors they are, and how to rebuild the dense weight.

A linear layer ``X`` quantized by ``load_in_8bit=True`` and saved by ``save_pretrained`` holds:

    X.weight         I8  [out, in]  row-major codes, round(w * 127 / absmax(row))
    X.SCB            F32 [out]      each row's absmax (the weight cast to fp16 first, so fp16 values)
    X.weight_format  U8  []         the layout: 0 row-major; 1 col32, 2 col_turing, 3 col_ampere are the
                                    tiled layouts bitsandbytes 0.42-0.44 saved after a GPU forward pass
                                    (0.45+ saves and loads only 0.) Older checkpoints may lack it.

Modules in ``llm_int8_skip_modules`` (and lm_head, tied embeddings) stay dense and are not ours.

The arithmetic is bitsandbytes' ``int8_vectorwise_dequant`` (``bitsandbytes/_ops.py``, the one kernel
registered for every device, CompositeExplicitAutograd: plain torch ops, no native CPU or CUDA code)
followed by transformers' cast in ``dequantize_bnb_weight`` / ``dequantize_and_replace``:

    out[r, c] = round_T( fl32( fl32(weight[r, c] * SCB[r]) * fl32(1/127) ) )

Why it is exact on every device: int8 -> fp32 is exact; each multiply is one IEEE fp32 multiply,
correctly rounded to nearest even with gradual underflow on CPU and CUDA alike (torch builds without
fast-math or flush-to-zero, and eager mode launches one kernel per op, so there is no FMA contraction
and no reassociation); the constant 7.874015718698502e-3 is exactly fp32(1/127), so it means the same
whether an op multiplies in fp32 or in double (the product of two fp32 values is exact in double, so
rounding it once to fp32 is the fp32 multiply); the cast to fp16/bf16 rounds to nearest even on both.
The order matters: (weight * SCB) * (1/127), never weight * (SCB / 127).
One exception, seen on an H100: NaN bits. A non-finite SCB (never written by bitsandbytes) gives NaNs whose
bits differ by device (x86 makes 0xffc00000 for inf * 0 and keeps payloads; CUDA makes 0x7fffffff), so a
CPU and a GPU result then agree only as NaN; on one device ours and bitsandbytes' agree bit for bit.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..dtypes import DTYPES, OUTPUT_DTYPES
from ..errors import ArgumentError, CheckpointError
from ..safetensors_io.read import TensorInfo
from .base import register
from .bnb import Bitsandbytes

if TYPE_CHECKING:
    import torch

    from ..safetensors_io.read import TensorReader

PARTS = ("SCB", "weight_format")
# The tensors whose bytes the plan reads (one float per row, one byte): a headers-only copy holds just these.
PLAN_READS = re.compile(r"\.(?:SCB|weight_format)$")

# bitsandbytes.utils.LINEAR_8BIT_WEIGHTS_FORMAT_MAPPING, inverted; only "row" is a plain [out, in] matrix.
WEIGHT_FORMATS = {0: "row", 1: "col32", 2: "col_turing", 3: "col_ampere"}
ROW_MAJOR = 0

# Exactly fp32(1/127): the literal bitsandbytes multiplies by.
INV_127 = 7.874015718698502e-3


@register
class Bnb8bit(Bitsandbytes):
    """bitsandbytes 8-bit (LLM.int8) checkpoints."""

    name: ClassVar[str] = "bnb-8bit"
    title: ClassVar[str] = "bitsandbytes 8-bit (LLM.int8)"
    name_suffix: ClassVar[str] = r"(?:bnb-)?(?:8bit|int8)"
    plan_reads: ClassVar[re.Pattern] = PLAN_READS
    marks: ClassVar[str] = "an 8-bit SCB"
    card_tags: ClassVar[frozenset[str]] = Bitsandbytes.card_tags | {"bnb-8bit", "8-bit", "8bit", "int8", "llm.int8"}
    only, other = "load_in_8bit", "load_in_4bit"

    @classmethod
    def config_problem(cls, quantization_config: dict) -> str | None:
        """With ``llm_int8_has_fp16_weight`` an 8-bit model keeps and saves its weights in fp16: bitsandbytes never
        quantized them."""
        if (
            quantization_config.get("load_in_8bit") is True
            and quantization_config.get("llm_int8_has_fp16_weight") is True
        ):
            return (
                "saved with llm_int8_has_fp16_weight=True, so its weights are dense fp16 already (bitsandbytes never "
                "quantized them): remove quantization_config from config.json and load it as a dense model"
            )
        return None

    @classmethod
    def is_quantization_key(cls, tensor_name: str) -> bool:
        return tensor_name.endswith(tuple("." + part for part in PARTS))

    @classmethod
    def exactness(cls, dtype_flag: str, several: bool) -> str:
        return (
            f"Every weight dequantized{' from 8-bit' if several else ''} is bit for bit what bitsandbytes' "
            "`int8_vectorwise_dequant` (plain torch arithmetic, the same on CPU and GPU) and the cast to "
            f"{dtype_flag} give, as transformers' `dequantize()` does; the 8-bit model itself multiplies "
            "in int8 (LLM.int8) and never forms these weights, so its outputs are close to, not equal "
            "to, those of a model with these weights."
        )


@dataclass(frozen=True)
class Weight8bit:
    """One 8-bit quantized weight: its output name and the source tensors it is rebuilt from."""

    name: str  # the dense weight's name, e.g. "model.layers.0.mlp.up_proj.weight"
    weight: TensorInfo  # I8 [out, in]
    scb: TensorInfo  # F32 [out]
    weight_format: TensorInfo | None  # absent in checkpoints saved before bitsandbytes wrote it

    @property
    def shape(self) -> tuple:
        return self.weight.shape

    @property
    def sources(self) -> tuple[TensorInfo, ...]:
        return tuple(info for info in (self.weight, self.scb, self.weight_format) if info is not None)

    @property
    def source_keys(self) -> tuple[str, ...]:
        keys = (self.weight.name, self.scb.name)
        return keys if self.weight_format is None else (*keys, self.weight_format.name)


def find_weights(tensors: dict[str, TensorInfo], reader: TensorReader) -> list[Weight8bit]:
    """Every 8-bit quantized weight of a checkpoint, validated, in name order.

    ``tensors`` is the whole checkpoint (``checkpoint.read_tensors``: a weight and its SCB may sit in
    different shards). Only each weight_format scalar and SCB (one float per row) is read, through ``reader``. An I8
    tensor with neither an SCB nor a weight_format beside it is a plain integer tensor and is not returned.
    Raises ``CheckpointError`` naming the file and tensor for anything that cannot be dequantized.
    """
    prefixes = {key[: -len(part)] for key in tensors for part in PARTS if key.endswith("." + part)}
    found = []
    for prefix in sorted(prefixes):
        name = prefix + "weight"
        weight, scb, weight_format = (tensors.get(prefix + part) for part in ("weight", "SCB", "weight_format"))
        if weight is None:
            orphan = scb if scb is not None else weight_format
            raise CheckpointError(
                f"{orphan.path}: tensor '{orphan.name}' is 8-bit quantization data but its weight '{name}' is missing"
            )
        if scb is None:
            raise CheckpointError(
                f"{weight_format.path}: tensor '{weight_format.name}' marks '{name}' as 8-bit, "
                f"but its scales '{prefix}SCB' are missing"
            )
        at_weight, at_scb = f"{weight.path}: tensor '{name}'", f"{scb.path}: tensor '{scb.name}'"
        if weight.dtype != "I8":
            raise CheckpointError(f"{at_weight} has 8-bit scales ('{scb.name}') but is {weight.dtype}, not I8")
        if len(weight.shape) != 2:
            raise CheckpointError(f"{at_weight} is an 8-bit weight of shape {list(weight.shape)}, [out, in] expected")
        if scb.dtype != "F32":
            raise CheckpointError(f"{at_scb} (8-bit scales) is {scb.dtype}, F32 expected")
        if scb.shape != weight.shape[:1]:
            raise CheckpointError(
                f"{at_scb} has shape {list(scb.shape)}, one scale per row of '{name}' {list(weight.shape)} "
                f"expected: [{weight.shape[0]}]"
            )
        if weight_format is not None:
            _check_row_major(weight_format, reader)
        # Row absmaxes are finite and >= 0 as bitsandbytes writes them; anything else would make NaN or inf
        # weights whose bits even differ between CPU and GPU (see above). One float per row: cheap to read.
        scales = reader.tensor(scb)
        if not bool(((scales >= 0) & scales.isfinite()).all()):
            raise CheckpointError(f"{at_scb} holds a negative, NaN or infinite scale; bitsandbytes writes row absmaxes")
        found.append(Weight8bit(name, weight, scb, weight_format))
    return found


def unclaimed_int8(tensors: dict[str, TensorInfo], weights: list[Weight8bit], quantization: dict | None) -> None:
    """CheckpointError for an I8 ``X.weight`` matrix with neither SCB nor weight_format where 8-bit weights are: a
    layer named like a quantized one (``...layers.1.up_proj`` beside a quantized ``...layers.0.up_proj``), or any
    layer when the quantization_config says 8-bit and no weight kept its scales. Its scales were lost, and copied
    through it would be written as an integer "dense" weight. (Other I8 tensors are plain integer tensors.)"""
    if not weights and not (quantization or {}).get("load_in_8bit"):
        return
    layers = {weight.name.rsplit(".", 2)[-2] for weight in weights if weight.name.count(".") >= 1}
    claimed = {weight.name for weight in weights}
    for name, info in tensors.items():
        suspect = not weights or (name.count(".") >= 1 and name.rsplit(".", 2)[-2] in layers)
        if name.endswith(".weight") and name not in claimed and info.dtype == "I8" and len(info.shape) == 2 and suspect:
            raise CheckpointError(
                f"{info.path}: '{name}' is an 8-bit weight (I8 {list(info.shape)}) with no "
                f"'{name.removesuffix('weight')}SCB' scales: not in the checkpoint"
            )


def _check_row_major(weight_format: TensorInfo, reader: TensorReader) -> None:
    where = f"{weight_format.path}: tensor '{weight_format.name}'"
    dtype, shape = weight_format.dtype, list(weight_format.shape)
    if dtype not in DTYPES or dtype[0] not in "IU" or math.prod(shape) != 1:
        raise CheckpointError(f"{where} should be one integer, not {dtype} of shape {shape}")
    value = int(reader.tensor(weight_format).reshape(()).item())
    if value != ROW_MAJOR:
        layout = "unknown"
        if value in WEIGHT_FORMATS:
            layout = f"'{WEIGHT_FORMATS[value]}', a tiled GPU layout of bitsandbytes 0.42-0.44"
        raise CheckpointError(f"{where} says weight format {value} ({layout}); only 0 (row-major) can be dequantized")


def dequantize(weight: torch.Tensor, scb: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The dense weight of int8 ``weight`` [rows, in] and its fp32 row scales ``scb`` [rows], as ``out_dtype``.

    Bit for bit ``bitsandbytes.functional.int8_vectorwise_dequant(weight, scb).to(out_dtype)`` on any
    device (see the module docstring for why); every row stands alone, so a slice of whole rows with
    the same slice of ``scb`` gives those rows of the whole. Raises ``ValueError`` for wrong dtypes or shapes.
    """
    import torch

    if weight.dtype != torch.int8 or scb.dtype != torch.float32:
        raise ArgumentError(
            f"8-bit dequantize takes an int8 weight and float32 scales, not {weight.dtype}, {scb.dtype}"
        )
    if weight.dim() != 2 or scb.shape != weight.shape[:1]:
        shapes = f"{list(weight.shape)} and {list(scb.shape)}"
        raise ArgumentError(f"8-bit dequantize takes a weight [rows, in] and scales [rows], not {shapes}")
    if weight.device != scb.device:
        raise ArgumentError(f"8-bit dequantize: weight on {weight.device}, scales on {scb.device}")
    if out_dtype not in tuple(dtype.torch for dtype in OUTPUT_DTYPES.values()):
        raise ArgumentError(f"8-bit dequantize writes float16, bfloat16 or float32, not {out_dtype}")
    # int8 * fp32 promotes to fp32 exactly; then the second multiply in place (same rounding, one buffer).
    scaled = weight * scb.view(-1, 1)
    scaled.mul_(INV_127)
    return scaled if out_dtype == torch.float32 else scaled.to(out_dtype)
