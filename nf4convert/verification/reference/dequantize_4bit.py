"""The reference of a 4-bit weight: bitsandbytes' ``dequantize_4bit`` on a GPU; on the CPU, where bitsandbytes' own op
is not its CUDA kernels' arithmetic, the independent CPU reference of that arithmetic (``cuda_arithmetic.py``).

A weight is recomputed in runs of whole quant blocks, each from a bitsandbytes ``QuantState`` of its own blocks (and,
double-quantized, of whole nested blocks, so that each block's scale decodes from the same nested absmax entry as in
the whole weight): every element depends on its byte and its block's scale alone, so a run comes out as it does in
the whole weight.
"""

from __future__ import annotations

from ...dtypes import DTYPES
from .base import BITSANDBYTES, Library, Slice, as_bytes, whole

CPU_REFERENCE = "the CPU reference of bitsandbytes' CUDA arithmetic"


def against(tensor, device) -> str:
    return "bitsandbytes" if getattr(device, "type", device) == "cuda" else CPU_REFERENCE


def libraries(recipe) -> tuple[Library, ...]:
    return (BITSANDBYTES,)  # its quant state, on either device


def slices(tensor, reader, device, context, piece_bytes: int):
    """The weight's quant state is read once, by bitsandbytes (``QuantState.from_dict``), and checked whole."""
    import math

    from .cuda_arithmetic import check, quant_state_from_tensors

    weight = tensor.recipe.weight
    parts = {info.name: reader.tensor(info) for info in weight.parts.values()}
    state = quant_state_from_tensors(parts, device, file=weight.packed.path)
    dtype = DTYPES[tensor.dtype]
    check(weight.packed.nbytes, state, dtype.torch)
    n_elements = math.prod(state.shape)
    unit = state.blocksize * (state.state2.blocksize if state.nested else 1)  # even: runs start on a whole byte
    step = max(unit, piece_bytes // dtype.itemsize // unit * unit)
    for first in range(0, n_elements, step):
        count = min(step, n_elements - first)
        run = _run(weight.packed, first, count, state_of_run(state, first, count), dtype.torch, device)
        yield Slice(first * dtype.itemsize, count * dtype.itemsize, run)


def state_of_run(state, first: int, count: int):
    """The bitsandbytes ``QuantState`` of elements ``[first, first + count)`` of ``state``'s weight, flat: its blocks'
    absmax and, nested, their nested blocks' absmax (``first`` a multiple of blocksize x nested blocksize)."""
    import torch
    from bitsandbytes.functional import QuantState

    first_block, end_block = first // state.blocksize, -(-(first + count) // state.blocksize)
    state2 = None
    if state.nested:
        nested = state.state2
        state2 = QuantState(
            absmax=nested.absmax[first_block // nested.blocksize : -(-end_block // nested.blocksize)],
            code=nested.code,
            blocksize=nested.blocksize,
            dtype=nested.dtype,
        )
    return QuantState(
        absmax=state.absmax[first_block:end_block],
        shape=torch.Size([count]),
        code=state.code,
        blocksize=state.blocksize,
        quant_type=state.quant_type,
        dtype=state.dtype,
        offset=state.offset,
        state2=state2,
    )


def _run(packed, first: int, count: int, state, dtype, device):
    def make(read, take):
        from .cuda_arithmetic import dequantize_4bit

        raw = read(packed, first // 2, (count + 1) // 2)
        out = take(count * dtype.itemsize) if getattr(device, "type", device) == "cpu" else None
        return as_bytes(dequantize_4bit(raw, state, dtype=dtype, device=device, out=out))

    return make


def reference(tensor, reader, device, context):
    return whole(tensor, reader, device, context)
