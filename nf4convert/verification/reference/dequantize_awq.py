"""The reference of an AWQ weight: GPTQModel's AWQ dequantization, re-expressed statement by statement in plain torch.

GPTQModel is the library transformers loads AWQ checkpoints with, but gptqmodel 7.7.0 requires torch >= 2.14.1, so
it is not a dependency; this module restates the pinned source, independently of the converter's code
(``formats/awq``), and ``tests/test_int_formats.py`` checks it against gptqmodel itself where gptqmodel is installed.
Re-expressed from gptqmodel 7.7.0, ``gptqmodel/quantization/awq/utils/packing_utils.py``:

- GEMM: ``dequantize_gemm`` (what ``nn_modules/qlinear/torch_awq.py: AwqTorchLinear`` computes with), through
  ``unpack_awq`` / ``_unpack_columnwise`` (4-bit: shifts 0, 4, ..., 28 of each word, ``& 15``) and
  ``reverse_awq_order`` (``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]``), then
  ``(iweight - izeros.repeat_interleave(group)) * scales.repeat_interleave(group)``.
- GEMV: GPTQModel dequantizes this layout only inside its CUDA kernel (``gemv_cuda.cu``: fp32
  ``scale * (weight - zero)`` per element, of the same codes and zeros); its one torch decoding of the layout is
  ``utils/mlx_packing.py: repack_awq_gemv`` (plain nibble order along the input, zeros of each row's groups, scales
  ``[:, :groups]``). This applies ``dequantize_gemm``'s arithmetic to that decoding.

Deliberately not followed: ``utils/model_dequant.py: convert_awq_file`` (``gptqmodel`` file-level
``dequantize_model``), which unpacks GEMM words with ``unpack_cols`` in plain nibble order, without
AWQ_REVERSE_ORDER: it swaps output columns inside every group of eight.
"""

from __future__ import annotations

from ...dtypes import DTYPES
from ...errors import CheckpointError
from .base import Slice, as_bytes, unpacking_rows, whole

VERSION = "7.7.0"
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def against(tensor, device) -> str:
    if _settings(tensor.recipe.weight.quantization, tensor.name)[0] == "gemv":
        return f"gptqmodel {VERSION} (dequantize_gemm's arithmetic on its GEMV decoding, restated)"
    return f"gptqmodel {VERSION} (its AWQ dequantize_gemm arithmetic, restated)"


def slices(tensor, reader, device, context, piece_bytes: int):
    """Runs of whole output rows (GEMM: a multiple of 8, whole packed words). The packed tensors are read once."""
    weight = tensor.recipe.weight
    layout, group_size = _settings(weight.quantization, weight.name)
    qweight, qzeros, scales = (
        reader.tensor(info).to(device) for info in (weight.qweight, weight.qzeros, weight.scales)
    )
    gemm = layout == "gemm"
    in_features, out_features = (
        (qweight.shape[0], scales.shape[1]) if gemm else (qweight.shape[1] * 8, qweight.shape[0])
    )
    group_size = in_features if group_size == -1 else group_size
    row_bytes = in_features * DTYPES[tensor.dtype].itemsize
    step = unpacking_rows(piece_bytes, row_bytes, 8, device)
    for first in range(0, out_features, step):
        count = min(step, out_features - first)
        if gemm:
            parts = (
                qweight[:, first // 8 : (first + count) // 8],
                qzeros[:, first // 8 : (first + count) // 8],
                scales[:, first : first + count],
            )
        else:
            parts = (qweight[first : first + count], qzeros[first : first + count], scales[first : first + count])
        yield Slice(first * row_bytes, count * row_bytes, _rows(tensor, parts, layout, group_size))


def _rows(tensor, parts, layout, group_size):
    def make(read, take):
        compute = _dequantize_gemm if layout == "gemm" else _dequantize_gemv
        dense = compute(*parts, 4, group_size)
        return as_bytes(dense.to(DTYPES[tensor.dtype].torch))

    return make


def reference(tensor, reader, device, context):
    return whole(tensor, reader, device, context)


def _settings(quantization: dict, name: str) -> tuple[str, int]:
    layout = (quantization.get("version") or quantization.get("format") or "gemm").lower()
    bits, group_size = quantization.get("bits", 4), quantization.get("group_size", 128)
    if bits != 4 or layout not in ("gemm", "gemv"):
        raise CheckpointError(f"'{name}': AWQ bits={bits!r} version={layout!r} have no reference here")
    return layout, group_size


def _unpack_awq(qweight, qzeros, bits: int, count: int):
    """unpack_awq -> _unpack_columnwise, the 4-bit branch."""
    import torch

    def columnwise(qtensor):
        shifts = torch.arange(0, 32, bits, device=qtensor.device)
        unpacked = torch.bitwise_right_shift(qtensor[:, :, None], shifts[None, None, :])
        unpacked = unpacked.view(qtensor.shape[0], -1) & 15
        return unpacked[..., :count]

    return columnwise(qweight), columnwise(qzeros)


def _reverse_awq_order(iweights, izeros, bits: int):
    import torch

    reverse_order_tensor = torch.arange(iweights.shape[-1], dtype=torch.int32, device=iweights.device)
    reverse_order_tensor = reverse_order_tensor.view(-1, 32 // bits)
    reverse_order_tensor = reverse_order_tensor[:, AWQ_REVERSE_ORDER]
    reverse_order_tensor = reverse_order_tensor.view(-1)
    return iweights[:, reverse_order_tensor], izeros[:, reverse_order_tensor]


def _dequantize_gemm(qweight, qzeros, scales, bits: int, group_size: int):
    """dequantize_gemm, as [out, in]."""
    import torch

    iweight, izeros = _unpack_awq(qweight, qzeros, bits, scales.shape[-1])
    iweight, izeros = _reverse_awq_order(iweight, izeros, bits)
    iweight = torch.bitwise_and(iweight, (2**bits) - 1)
    izeros = torch.bitwise_and(izeros, (2**bits) - 1)
    scales = scales.repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    iweight = (iweight - izeros) * scales
    return iweight.T


def _dequantize_gemv(qweight, qzeros, scales, bits: int, group_size: int):
    """repack_awq_gemv's decoding of the GEMV layout (in torch), with dequantize_gemm's arithmetic, as [out, in]."""
    import torch

    out_features, in_features = qweight.shape[0], qweight.shape[1] * 8
    groups = in_features // group_size
    shifts = torch.arange(8, device=qweight.device, dtype=torch.int64) * 4
    codes = ((qweight.to(torch.int64)[..., None] >> shifts) & 15).reshape(out_features, in_features)
    zeros = ((qzeros.to(torch.int64)[..., None] >> shifts) & 15).reshape(out_features, -1)[:, :groups]
    scales = scales[:, :groups]
    return (codes - zeros.repeat_interleave(group_size, dim=1)) * scales.repeat_interleave(group_size, dim=1)
