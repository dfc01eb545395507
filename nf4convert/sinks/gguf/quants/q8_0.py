"""Q8_0 as ggml writes it (``quantize_row_q8_0_ref``, which ignores an importance matrix): 32-value blocks,
``d = max|x| / 127`` and ``roundf(x / d)`` as int8. Block: fp16 d, 32 int8.

The GGUF sink's own Q8_0 (``sinks/gguf/q8_0.py``, torch on the route's device) computes gguf-py's quantizer, the
converter's; this is the one llama-quantize's plan falls back to."""

from __future__ import annotations

import numpy as np

from .arith import F32, fp16_bits, half_bytes, roundf, to_uint8, trunc_to_int
from .base import QUANTS, QuantType
from .xp import namespace


@QUANTS.register
class Q8_0(QuantType):
    name = "Q8_0"
    type_id = 8
    block_size = 32
    type_size = 34
    uses_imatrix = False

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square):
        xp = namespace(blocks)
        amax = xp.zeros(blocks.shape[0], F32, blocks)
        for value in xp.abs(xp.contiguous(blocks.T)):
            amax = xp.where(amax > value, amax, value)  # MAX(amax, fabsf(v))
        d = xp.div(amax, F32(127))
        inverse = xp.where(d != 0, xp.div(F32(1), d), F32(0))
        out = xp.empty((blocks.shape[0], cls.type_size), np.uint8, blocks)
        out[:, :2] = half_bytes(fp16_bits(d))
        out[:, 2:] = to_uint8(trunc_to_int(roundf(blocks * inverse[:, None])))
        return out
