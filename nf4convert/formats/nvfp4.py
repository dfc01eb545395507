"""NVFP4 weights (two E2M1 values a byte, one E4M3 scale per 16 values, one fp32 scale per tensor): the record of
one weight and the arithmetic that makes its dense rows, in pieces, shared by the formats that store them
(compressed-tensors ``nvfp4-pack-quantized``, ``compressed_nvfp4.py``; ModelOpt's NVFP4, ``modelopt.py``). Not a format
of its own.

A weight ``X`` [out, in] is stored as

    packed        U8 [out, in / 2]     E2M1 codes, the LOW nibble first: byte b holds values 2b (low) and 2b + 1
                                       (high); nibble bit 3 the sign, bits 2-0 the magnitude 0, .5, 1, 1.5, 2, 3, 4, 6
    scale         F8_E4M3 [out, in / 16]   one scale per 16 values of a row (whole groups: ``in`` a multiple of 16)
    global scale  F32 [1]              one per tensor

The reference, compressed-tensors 0.20 (``compressors/nvfp4/base.py: NVFP4PackedCompressor.decompress``):
``unpack_fp4_from_uint8`` makes the values (``kE2M1ToFloat[magnitude] * where(sign, -1.0, 1.0)``, in bf16; exact,
nibble 8 is -0.0), the scale is cast to that dtype (exact: every E4M3 value is a bf16, fp16 and fp32 value), then
``forward_helpers._dequantize``: ``scale = scale / global_scale`` (a bf16 [out, groups] tensor over an fp32 [1]
one: torch promotes to fp32, one IEEE division), ``x_q.to(scale.dtype) * scale`` (one fp32 multiply), then the cast
to the values' dtype. The global scale *divides* here. So per element, with ``s`` its group's scale, ``g`` the
tensor's:

    out = round_T( fl32( e2m1 * fl32( fp32(s) / fp32(g) ) ) )

decompress itself writes bf16; the same library functions with the output dtype in place of bf16 (what transformers'
load in that dtype would ask) give fp16 and fp32 by the same formula, the fp32 one being the value decompress rounds.
CPU and CUDA agree bit for bit: table lookups and integer ops, one IEEE division and one multiply (both correctly
rounded with gradual underflow on both devices in eager torch, nothing fused), one round-to-nearest-even cast. An
E4M3 NaN scale (0x7f, 0xff) would make NaNs whose bits differ by device: it is refused, as a NaN, infinite or zero
global scale is (compressed-tensors would divide by it).

ModelOpt (``modelopt/torch/quantization/qtensor/nvfp4_tensor.py: NVFP4QTensor.dequantize``, 0.47.0, its non-fast
path) stores the same codes and scales as ``weight`` / ``weight_scale`` and the tensor scale as ``weight_scale_2 =
amax / (6 * 448)``, the reciprocal of compressed-tensors' (whose ModelOpt converter writes ``1 / weight_scale_2``):
it *multiplies*. Its table (``e2m1_values``, fp32) holds +0.0 for nibble 8, not -0.0. It computes
``per_block_scale = scale.to(fp32) * weight_scale_2`` (one fp32 multiply), the values (fp32, looked up) times that,
then ``.to(dtype)``:

    out = round_T( fl32( e2m1' * fl32( fp32(s) * fp32(g2) ) ) )     (e2m1' with +0.0 at nibble 8)

Both formulas run here by the same ops, ``multiply`` choosing ModelOpt's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..dtypes import DTYPES, OUTPUT_DTYPES
from ..errors import ArgumentError, CheckpointError
from ..safetensors_io.read import TensorInfo

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ..safetensors_io.read import TensorReader

GROUP = 16  # values per E4M3 scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # index: the nibble
MODELOPT_E2M1 = (*E2M1[:8], 0.0, *E2M1[9:])  # ModelOpt's table: nibble 8 is +0.0
NAN_SCALES = (0x7F, 0xFF)  # the E4M3 NaN bytes


@dataclass(frozen=True)
class WeightNvfp4:
    """One NVFP4 weight: its output name, its tensors, and (compressed-tensors) its config group's weights args."""

    name: str  # the dense weight's name, "X.weight"
    module: str  # "X"
    packed: TensorInfo  # U8 [out, in / 2]
    scale: TensorInfo  # F8_E4M3 [out, in / 16]
    global_scale: TensorInfo  # F32, one value
    format: str  # the format that found it ("compressed-tensors", "modelopt")
    args: tuple = ()  # compressed-tensors: the group's weights QuantizationArgs as sorted (key, value) pairs
    group: str = ""  # compressed-tensors: the config group's name; ModelOpt: the layer's quant_algo

    @property
    def multiplies(self) -> bool:
        """Whether the global scale multiplies (ModelOpt's ``weight_scale_2``) rather than divides."""
        return self.format == "modelopt"

    @property
    def shape(self) -> tuple:
        return (self.packed.shape[0], self.packed.shape[1] * 2)

    @property
    def sources(self) -> tuple[TensorInfo, ...]:
        return self.packed, self.scale, self.global_scale

    @property
    def groups(self) -> int:
        return self.shape[1] // GROUP


def check_tensors(
    packed: TensorInfo,
    scale: TensorInfo,
    global_scale: TensorInfo,
    reader: TensorReader,
    global_shapes: tuple[list, ...] = ([1],),
) -> None:
    """CheckpointError naming the tensor for a packed weight that is not U8 [out, in / 2] of whole groups, a scale
    that is not F8_E4M3 [out, in / 16], a global scale that is not F32 of one of ``global_shapes``, or one that is
    NaN, infinite or zero (read here: one value)."""
    import torch

    if packed.dtype != "U8" or len(packed.shape) != 2:
        raise CheckpointError(
            f"{packed.path}: tensor '{packed.name}' is {packed.dtype} {list(packed.shape)}; NVFP4 codes are U8 "
            "[out, in / 2] (two E2M1 values a byte)"
        )
    rows, columns = packed.shape[0], packed.shape[1] * 2
    if columns % GROUP:
        raise CheckpointError(
            f"{packed.path}: tensor '{packed.name}' {list(packed.shape)} holds {columns} values a row, not whole "
            f"groups of {GROUP}; NVFP4 weights are read in whole groups only"
        )
    if scale.dtype != "F8_E4M3" or list(scale.shape) != [rows, columns // GROUP]:
        raise CheckpointError(
            f"{scale.path}: tensor '{scale.name}' is {scale.dtype} {list(scale.shape)}, but '{packed.name}' "
            f"{list(packed.shape)} takes F8_E4M3 [{rows}, {columns // GROUP}] (one scale per {GROUP} values)"
        )
    if global_scale.dtype != "F32" or list(global_scale.shape) not in global_shapes:
        # compressed-tensors: [1], as it writes it (a 0-dim one would keep its division in the values' dtype)
        shapes = " or ".join(f"F32 {shape}" for shape in global_shapes)
        raise CheckpointError(
            f"{global_scale.path}: tensor '{global_scale.name}' is {global_scale.dtype} "
            f"{list(global_scale.shape)}, not {shapes} (the tensor's global scale)"
        )
    value = reader.tensor(global_scale).reshape(-1).to(torch.float32)
    if not bool(value.isfinite().all()) or bool((value == 0).any()):
        raise CheckpointError(
            f"{global_scale.path}: tensor '{global_scale.name}' is {value.item()!r}: a global scale must be finite "
            "and nonzero"
        )


def check_scales(scale: TensorInfo, stored) -> None:
    """CheckpointError if a piece's scale bytes (a uint8 tensor or array) hold an E4M3 NaN."""
    import numpy as np

    values = np.asarray(stored).reshape(-1)
    if bool(np.isin(values, NAN_SCALES).any()):
        raise CheckpointError(f"{scale.path}: tensor '{scale.name}' holds a NaN scale (E4M3 byte 0x7f or 0xff)")


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    out_dtype: torch.dtype,
    multiply: bool = False,
) -> torch.Tensor:
    """Rows of an NVFP4 weight, dense in ``out_dtype``: ``packed`` uint8 [rows, in / 2], ``scales`` their scales
    (float8_e4m3fn or its uint8 bytes, [rows, in / 16]), ``global_scale`` the fp32 tensor scale (any shape of one
    value), all on one device; ``multiply``: ModelOpt's formula (the global scale multiplies, nibble 8 is +0.0), else
    compressed-tensors'. Bit for bit the module docstring's formulas on CPU and CUDA alike."""
    import torch

    if packed.dtype != torch.uint8 or out_dtype not in tuple(dtype.torch for dtype in OUTPUT_DTYPES.values()):
        raise ArgumentError(f"NVFP4 dequantize takes uint8 codes into fp16/bf16/fp32, not {packed.dtype}, {out_dtype}")
    rows, half = packed.shape
    groups = half * 2 // GROUP
    if scales.numel() != rows * groups or packed.device != scales.device:
        raise ArgumentError(f"NVFP4 dequantize: codes {list(packed.shape)} and scales {list(scales.shape)} differ")
    table = torch.tensor(MODELOPT_E2M1 if multiply else E2M1, dtype=torch.float32, device=packed.device)
    nibbles = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(-1).to(torch.int32)
    values = table.index_select(0, nibbles).view(rows, groups, GROUP)
    scale = scales.contiguous().view(torch.float8_e4m3fn).reshape(rows, groups).to(torch.float32)
    tensor_scale = global_scale.reshape(()).to(device=packed.device, dtype=torch.float32)
    scale = scale * tensor_scale if multiply else scale / tensor_scale
    values.mul_(scale[..., None])
    values = values.view(rows, groups * GROUP)
    return values if out_dtype == torch.float32 else values.to(out_dtype)


def host(
    read: np.ndarray, out: np.ndarray, *, scales: np.ndarray, global_scale: float, out_code: str, multiply: bool = False
) -> None:
    """The CPU route's piece: ``read`` its rows' packed bytes, ``scales`` their scale bytes [rows, groups] (numpy
    uint8), ``out`` the piece's output bytes, written in place with :func:`dequantize`'s bytes."""
    import torch

    rows = scales.shape[0]
    packed = torch.from_numpy(read).view(rows, -1)
    dense = dequantize(
        packed, torch.from_numpy(scales), torch.tensor(global_scale), DTYPES[out_code].torch, multiply=multiply
    )
    torch.from_numpy(out).copy_(dense.reshape(-1).view(torch.uint8))
