"""The reference of an 8-bit (LLM.int8) weight: what bitsandbytes + transformers compute, ``int8_vectorwise_dequant``
then the cast."""

from __future__ import annotations

from ...dtypes import DTYPES

BLAME = "bitsandbytes"


def reference(tensor, reader, device, context):
    """bitsandbytes 0.50 registers one implementation of ``int8_vectorwise_dequant`` for all devices, the plain torch
    expression ``A * stats.view(-1, 1) * 7.874015718698502e-3`` (``bitsandbytes/_ops.py``): no native CPU kernel
    that could vary with the machine's instruction set, unlike its 4-bit CPU op."""
    import bitsandbytes.functional as F

    weight = tensor.recipe.weight
    codes, scb = reader.tensor(weight.weight).to(device), reader.tensor(weight.scb).to(device)
    return F.int8_vectorwise_dequant(codes, scb).to(DTYPES[tensor.dtype].torch)
