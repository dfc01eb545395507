"""The reference of a 4-bit weight: bitsandbytes' ``dequantize_4bit`` on a GPU; on the CPU, where bitsandbytes' own op
is not its CUDA kernels' arithmetic, the independent CPU reference of that arithmetic (``cuda_arithmetic.py``)."""

from __future__ import annotations

from ...dtypes import DTYPES

BLAME = "bitsandbytes"


def reference(tensor, reader, device, context):
    """bitsandbytes' CUDA result for a 4-bit weight: bitsandbytes itself on a GPU, its exact twin on the CPU."""
    from .cuda_arithmetic import dequantize_4bit, quant_state_from_tensors

    weight = tensor.recipe.weight
    parts = {info.name: reader.tensor(info) for info in weight.parts.values()}
    state = quant_state_from_tensors(parts, device, file=weight.packed.path)
    packed = reader.tensor(weight.packed)
    return dequantize_4bit(packed, state, dtype=DTYPES[tensor.dtype].torch, device=device)
