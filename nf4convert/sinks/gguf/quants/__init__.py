"""llama.cpp's quantizers (ggml-quants.c at the pinned llama.cpp) in numpy, byte for byte on x86-64: one module
per GGUF quant type, registered where it is defined (``QUANTS``; ``quant_type("Q4_K")``), and the arithmetic they
share (``arith``)."""

from .base import QUANTS, QuantType, quant_type

__all__ = ["QUANTS", "QuantType", "quant_type"]
