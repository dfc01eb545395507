"""E8M0 scales (the OCP MX spec's one-byte power of two, ``2 ** (byte - 127)``, byte 255 NaN) and the
power-of-two float scales of ``scale_fmt: "ue8m0"`` FP8 checkpoints: their values and their checks. Not a format of
its own: FP8 block scales (``fp8.py``) and DeepSeek-V4's experts read them.

Where each kind is found:

- DeepSeek-V3.1 and later write ``"scale_fmt": "ue8m0"`` in their FP8 quantization_config but keep each
  ``weight_scale_inv`` an F32 tensor: the maker's ``inference/model.py`` gives every FP8 ``Linear`` a float32
  ``scale`` parameter, and ``scale_fmt`` there only says how activations are quantized (``act_quant`` rounds their
  scales up to a power of two); the weights were made with power-of-two scales, so each F32 value is one.
- transformers' ``FineGrainedFP8Config(scale_fmt="ue8m0")`` ("1-byte ``torch.float8_e8m0fnu``, V4-style") loads
  one-byte F8_E8M0 scales, and views U8 scales as E8M0 bytes (``_process_model_after_weight_loading``).

So under ``ue8m0`` a scale tensor is F8_E8M0 or U8 (bytes), or F32/BF16/F16 holding powers of two; anything else
(a value that is not a positive power of two, a NaN byte) is refused, naming the tensor. An E8M0 value as fp32 is
torch's own conversion (``2 ** -127`` for byte 0, a subnormal; exact for every byte), taken once on the CPU as a
table of the 256 bytes and gathered on whichever device computes, so both routes use the same bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import CheckpointError
from ..safetensors_io.read import TensorInfo

if TYPE_CHECKING:
    import torch

    from ..safetensors_io.read import TensorReader

BYTE_CODES = ("F8_E8M0", "U8")  # one-byte scales: E8M0 exponents
FLOAT_CODES = ("F32", "BF16", "F16")  # float scales, each a power of two where the config says ue8m0
NAN_BYTE = 255


def values(scales: torch.Tensor) -> torch.Tensor:
    """The fp32 value of each E8M0 scale (a float8_e8m0fnu or uint8 tensor, on any device), exactly."""
    import torch

    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).to(torch.float32)
    index = scales.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
    return table.to(scales.device).index_select(0, index).reshape(scales.shape)


def is_bytes(scales: torch.Tensor) -> bool:
    """Whether a scale tensor holds E8M0 bytes (float8_e8m0fnu, or uint8 as transformers views them)."""
    import torch

    return scales.dtype in (torch.float8_e8m0fnu, torch.uint8)


def check(scale: TensorInfo, reader: TensorReader, what: str = "scale") -> None:
    """CheckpointError naming the tensor where one-byte E8M0 scales hold the NaN byte 255, or float scales hold a
    value that is not a positive power of two (NaN, inf, zero, negative included)."""
    import torch

    stored = reader.tensor(scale)
    if scale.dtype in BYTE_CODES:
        if bool((stored.view(torch.uint8) == NAN_BYTE).any()):
            raise CheckpointError(f"{scale.path}: tensor '{scale.name}' holds the E8M0 byte 255 (NaN) as a {what}")
        return
    fp32 = stored.to(torch.float32)
    mantissa, _ = torch.frexp(fp32)
    if not bool(((mantissa == 0.5) & fp32.isfinite()).all()):
        raise CheckpointError(
            f"{scale.path}: tensor '{scale.name}' holds a {what} that is not a power of two, but the "
            "quantization_config says scale_fmt 'ue8m0'"
        )
