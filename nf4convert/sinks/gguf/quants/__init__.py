"""llama.cpp's quantizers (ggml-quants.c at the pinned llama.cpp), byte for byte on x86-64: one module per GGUF quant
type, registered where it is defined (``QUANTS``; ``quant_type("Q4_K")``), and the arithmetic they share (``arith``).

``quant_type(name).quantize(rows, imatrix=None)``: ``rows`` (n_rows, n_per_row) as a float32 numpy array gives
numpy uint8 bytes (n_rows, row_size); as a torch tensor of any float dtype (bf16 included) on any device gives a
uint8 tensor on that device, the same bytes: the GPU route quantizes on the GPU. ``imatrix`` (numpy or torch):
float32 (n_per_row,) importance weights, or None. Each type's arithmetic is written once, over the operations of
``xp`` (numpy's or torch's), one IEEE float32 operation at a time in C's order."""

from .base import QUANTS, QuantType, quant_type

__all__ = ["QUANTS", "QuantType", "quant_type"]
