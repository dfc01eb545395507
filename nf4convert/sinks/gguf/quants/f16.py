"""F16 as ``ggml_quantize_chunk`` writes it (``ggml_fp32_to_fp16_row``, ggml's software conversion on x86-64):
each value rounded to nearest even, NaN as 0x7E00 with its sign."""

from __future__ import annotations

from .arith import fp16_bits, half_bytes
from .base import QUANTS, QuantType


@QUANTS.register
class F16(QuantType):
    name = "F16"
    type_id = 1
    block_size = 1
    type_size = 2
    uses_imatrix = False
    chunk_blocks = 1 << 20

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square):
        return half_bytes(fp16_bits(blocks.reshape(-1))).reshape(blocks.shape[0], 2)
