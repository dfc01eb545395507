"""The reference of a GPTQ weight: GPTQModel's arithmetic, re-expressed statement by statement in plain torch.

GPTQModel is the library transformers (through optimum) loads GPTQ checkpoints with, but gptqmodel 7.7.0 requires
torch >= 2.14.1 and JIT-builds its kernels, so it is not a dependency; this module restates the pinned source,
independently of the converter's code (``formats/gptq``), and ``tests/test_int_formats.py`` checks it against
gptqmodel itself where gptqmodel is installed (a CPU and a GPU case). Re-expressed from gptqmodel 7.7.0:

- ``gptqmodel/utils/model.py: convert_gptq_v1_to_v2_format_module`` (what ``hf_convert_gptq_v1_to_v2_format`` runs
  on load when ``checkpoint_format`` is "gptq"): 2/4/8-bit zeros get one added to every field by adding the constant
  0b..0101/0b..00010001/0b..00000001 to each packed word (``qzeros.data += ...``, wrapping in the word's dtype);
  3-bit zeros go through ``utils/model_dequant.py: _correct_gptq_v1_qzeros`` (unpack, +1 mod 8, repack).
- ``gptqmodel/nn_modules/qlinear/__init__.py: PackableQuantLinear.dequantize_weight`` and ``_dequantize_from_codes``
  (``TorchLinear._dequantize_weight_cached_248`` is the same formula for 2/4/8 bits): the ``wf`` shift tables of
  ``_init_wf_unsqueeze_buffers``, codes cast to int8 (int16 for 8 bits), ``scales[g_idx] * (weight - zeros[g_idx])``.

transformers' ``checkpoint_format`` reading (``GPTQConfig``): "checkpoint_format" overrides "format", default "gptq".
"""

from __future__ import annotations

from ...dtypes import DTYPES
from ...errors import CheckpointError
from .base import Slice, as_bytes, unpacking_rows, whole

VERSION = "7.7.0"
_WIDTH = {"I8": 8, "I16": 16, "I32": 32}
# PackableQuantLinear._init_wf_unsqueeze_buffers' 3-bit table
_WF_3BIT = (
    (0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 0),
    (0, 1, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31),
    (0, 2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 0),
)
# convert_gptq_v1_to_v2_format_module's constants, by bits and word width
_V1_OFFSETS = {
    2: {8: 0b01010101, 16: 0b0101010101010101, 32: 0b01010101010101010101010101010101},
    4: {8: 0b00010001, 16: 0b0001000100010001, 32: 0b00010001000100010001000100010001},
    8: {8: 0b00000001, 16: 0b0000000100000001, 32: 0b00000001000000010000000100000001},
}


def against(tensor, device) -> str:
    return f"gptqmodel {VERSION} (its torch kernel's arithmetic, restated)"


def slices(tensor, reader, device, context, piece_bytes: int):
    """Runs of whole output rows, 32 at a time or more (whole qzeros words): each row is one qweight column with its
    scales and zeros. The packed tensors are read once (a quarter of the weight's fp16 size at most)."""
    weight = tensor.recipe.weight
    qweight, qzeros, scales, g_idx = (
        reader.tensor(info).to(device) for info in (weight.qweight, weight.qzeros, weight.scales, weight.g_idx)
    )
    out_features, in_features = qweight.shape[1], g_idx.shape[0]
    row_bytes = in_features * DTYPES[tensor.dtype].itemsize
    step = unpacking_rows(piece_bytes, row_bytes, 32, device)
    for first in range(0, out_features, step):
        count = min(step, out_features - first)
        yield Slice(first * row_bytes, count * row_bytes, _rows(tensor, qweight, qzeros, scales, g_idx, first, count))


def _rows(tensor, qweight, qzeros, scales, g_idx, first, count):
    def make(read, take):
        weight = tensor.recipe.weight
        bits, v1 = _settings(weight.quantization, weight.name)
        width = _WIDTH[weight.qweight.dtype]
        words = slice(first * bits // width, -(-(first + count) * bits // width))
        zeros = qzeros[:, words].clone()
        if v1:
            zeros = _v1_to_v2(zeros, bits, width)
        dense = _dequantize_weight(
            qweight[:, first : first + count], zeros, scales[:, first : first + count], g_idx, bits
        )
        return as_bytes(dense.T.to(DTYPES[tensor.dtype].torch))

    return make


def reference(tensor, reader, device, context):
    return whole(tensor, reader, device, context)


def _settings(quantization: dict, name: str) -> tuple[int, bool]:
    bits = quantization.get("bits")
    chosen = (quantization.get("checkpoint_format") or quantization.get("format") or "gptq").lower()
    if bits not in (2, 3, 4, 8) or chosen not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"'{name}': GPTQ bits={bits!r} checkpoint_format={chosen!r} have no reference here")
    return bits, chosen == "gptq"


def _v1_to_v2(qzeros, bits: int, width: int):
    if bits == 3:
        return _pack_cols_3bit(((_unpack_cols_3bit(qzeros) + 1) & 0x7), qzeros.dtype)
    qzeros += _V1_OFFSETS[bits][width]  # gptqmodel: module.qzeros.data += 0b...; wraps in the word's dtype
    return qzeros


def _dequantize_weight(qweight, qzeros, scales, g_idx, bits: int):
    """PackableQuantLinear.dequantize_weight for non-planar 2/3/4/8 bits, then _dequantize_from_codes (num_itr 1)."""
    import torch

    device = qweight.device
    pack_dtype_bits = qweight.element_size() * 8
    maxq = 2**bits - 1
    dequant_dtype = torch.int16 if bits == 8 else torch.int8
    in_features = g_idx.shape[0]
    if bits in (2, 4, 8):
        pack_factor = pack_dtype_bits // bits
        wf = torch.tensor(list(range(0, pack_dtype_bits, bits)), dtype=torch.int32).unsqueeze(0).to(device)
        wf_unsqueeze_zero, wf_unsqueeze_neg_one = wf.unsqueeze(0), wf.unsqueeze(-1)
        zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, pack_factor), wf_unsqueeze_zero).to(
            dequant_dtype
        )
        zeros = torch.bitwise_and(zeros, maxq).reshape(qzeros.shape[0], -1)
        zeros = zeros[:, : scales.shape[1]]
        weight = torch.bitwise_and(
            torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, pack_factor, -1), wf_unsqueeze_neg_one).to(
                dequant_dtype
            ),
            maxq,
        )
    else:
        wf = torch.tensor(_WF_3BIT, dtype=torch.int32).reshape(1, 3, 12).to(device)
        wf_unsqueeze_zero, wf_unsqueeze_neg_one = wf.unsqueeze(0), wf.unsqueeze(-1)
        zeros = qzeros.reshape(qzeros.shape[0], qzeros.shape[1] // 3, 3, 1).expand(-1, -1, -1, 12)
        zeros = torch.bitwise_right_shift(zeros, wf_unsqueeze_zero)
        zeros[:, :, 0, 10] = (zeros[:, :, 0, 10] & 0x3) | (torch.bitwise_left_shift(zeros[:, :, 1, 0], 2) & 0x4)
        zeros[:, :, 1, 11] = (zeros[:, :, 1, 11] & 0x1) | (torch.bitwise_left_shift(zeros[:, :, 2, 0], 1) & 0x6)
        zeros = zeros & 0x7
        zeros = torch.cat([zeros[:, :, 0, :11], zeros[:, :, 1, 1:12], zeros[:, :, 2, 1:11]], dim=2).reshape(
            scales.shape
        )
        weight = qweight.reshape(qweight.shape[0] // 3, 3, 1, qweight.shape[1]).expand(-1, -1, 12, -1)
        weight = torch.bitwise_right_shift(weight, wf_unsqueeze_neg_one) & 0x7
        weight[:, 0, 10] = (weight[:, 0, 10] & 0x3) | (torch.bitwise_left_shift(weight[:, 1, 0], 2) & 0x4)
        weight[:, 1, 11] = (weight[:, 1, 11] & 0x1) | (torch.bitwise_left_shift(weight[:, 2, 0], 1) & 0x6)
        weight = weight & 0x7
        weight = torch.cat([weight[:, 0, :11], weight[:, 1, 1:12], weight[:, 2, 1:11]], dim=1)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    if weight.shape[0] > in_features:
        weight = weight[:in_features]
    return scales[g_idx.long()] * (weight - zeros[g_idx.long()])


def _unpack_cols_3bit(packed):
    """gptqmodel/utils/model_dequant.py: _unpack_cols_3bit."""
    import torch

    rows, cols = packed.shape
    blocks = cols // 3
    words = packed.to(torch.int64).reshape(rows, blocks, 3)
    word0, word1, word2 = words[:, :, 0], words[:, :, 1], words[:, :, 2]
    result = torch.empty((rows, blocks * 32), dtype=torch.int32, device=packed.device)
    unpacked = result.view(rows, blocks, 32)
    for idx in range(10):
        unpacked[:, :, idx] = ((word0 >> (3 * idx)) & 0x7).to(torch.int32)
    unpacked[:, :, 10] = (((word0 >> 30) & 0x3) | (((word1 >> 0) << 2) & 0x4)).to(torch.int32)
    for idx in range(10):
        unpacked[:, :, 11 + idx] = ((word1 >> (1 + 3 * idx)) & 0x7).to(torch.int32)
    unpacked[:, :, 21] = (((word1 >> 31) & 0x1) | (((word2 >> 0) << 1) & 0x6)).to(torch.int32)
    for idx in range(10):
        unpacked[:, :, 22 + idx] = ((word2 >> (2 + 3 * idx)) & 0x7).to(torch.int32)
    return result


def _pack_cols_3bit(values, pack_dtype):
    """gptqmodel/utils/model_dequant.py: _pack_cols_3bit."""
    import torch

    rows, cols = values.shape
    blocks = cols // 32
    values_i64 = (values.to(torch.int64) & 0x7).reshape(rows, blocks, 32)
    mask32 = (1 << 32) - 1
    word0 = torch.zeros((rows, blocks), dtype=torch.int64, device=values.device)
    for idx in range(10):
        word0 |= values_i64[:, :, idx] << (3 * idx)
    word0 |= values_i64[:, :, 10] << 30
    word1 = (values_i64[:, :, 10] >> 2) & 0x1
    for idx in range(10):
        word1 |= values_i64[:, :, 11 + idx] << (1 + 3 * idx)
    word1 |= values_i64[:, :, 21] << 31
    word2 = (values_i64[:, :, 21] >> 1) & 0x3
    for idx in range(10):
        word2 |= values_i64[:, :, 22 + idx] << (2 + 3 * idx)
    packed = torch.stack((word0, word1, word2), dim=2).reshape(rows, blocks * 3)
    return (packed & mask32).to(pack_dtype)
