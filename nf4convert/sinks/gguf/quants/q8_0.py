"""Q8_0 as ggml writes it (``quantize_row_q8_0_ref``, which ignores an importance matrix): 32-value blocks,
``d = max|x| / 127`` and ``roundf(x / d)`` as int8. Block: fp16 d, 32 int8.

The GGUF sink's own Q8_0 (``sinks/gguf/q8_0.py``, torch on the route's device) computes gguf-py's quantizer, the
converter's; this is the one llama-quantize's plan falls back to."""

from __future__ import annotations

import numpy as np

from .arith import F32, fp16_bits, half_bytes, roundf, to_uint8, trunc_to_int
from .base import QUANTS, QuantType


@QUANTS.register
class Q8_0(QuantType):
    name = "Q8_0"
    type_id = 8
    block_size = 32
    type_size = 34
    uses_imatrix = False

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square):
        amax = np.zeros(blocks.shape[0], dtype=F32)
        for value in np.abs(np.ascontiguousarray(blocks.T)):
            amax = np.where(amax > value, amax, value)  # MAX(amax, fabsf(v))
        d = amax / F32(127)
        inverse = np.where(d != 0, F32(1) / d, F32(0))
        out = np.empty((blocks.shape[0], cls.type_size), dtype=np.uint8)
        out[:, :2] = half_bytes(fp16_bits(d))
        out[:, 2:] = to_uint8(trunc_to_int(roundf(blocks * inverse[:, None])))
        return out
