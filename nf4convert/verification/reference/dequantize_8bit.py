"""The reference of an 8-bit (LLM.int8) weight: what bitsandbytes + transformers compute, ``int8_vectorwise_dequant``
then the cast, in runs of whole rows (each row has its own scale)."""

from __future__ import annotations

from ...dtypes import DTYPES
from .base import BITSANDBYTES, Library, Slice, as_bytes, whole


def against(tensor, device) -> str:
    return "bitsandbytes"


def libraries(recipe) -> tuple[Library, ...]:
    return (BITSANDBYTES,)


def slices(tensor, reader, device, context, piece_bytes: int):
    """bitsandbytes 0.50 registers one implementation of ``int8_vectorwise_dequant`` for all devices, the plain torch
    expression ``A * stats.view(-1, 1) * 7.874015718698502e-3`` (``bitsandbytes/_ops.py``): no native CPU kernel
    that could vary with the machine's instruction set, unlike its 4-bit CPU op; each element from its own row's
    scale alone, so a run of rows is computed as in the whole weight."""
    weight = tensor.recipe.weight
    rows, columns = weight.shape
    scb = reader.tensor(weight.scb).to(device)
    size = DTYPES[tensor.dtype].itemsize
    step = max(1, piece_bytes // max(1, columns * size))
    for first in range(0, rows, step):
        count = min(step, rows - first)
        yield Slice(first * columns * size, count * columns * size, _rows(tensor, scb, first, count, device))


def _rows(tensor, scb, first: int, count: int, device):
    def make(read, take):
        import bitsandbytes.functional as F
        import torch

        weight = tensor.recipe.weight
        columns = weight.shape[1]
        codes = read(weight.weight, first * columns, count * columns).view(torch.int8).reshape(count, columns)
        dense = F.int8_vectorwise_dequant(codes.to(device), scb[first : first + count])
        return as_bytes(dense.to(DTYPES[tensor.dtype].torch))

    return make


def reference(tensor, reader, device, context):
    return whole(tensor, reader, device, context)
