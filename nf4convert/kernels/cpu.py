"""The exact CPU path: the same arithmetic as kernels/nf4.py, in torch operations.

    A[k]   = fl32( fl32( code2[absmax_u8[k]] * absmax2[k // nested_blocksize] ) + offset )   nested
    out[e] = round_T( fl32( code[nibble(e)] * A[e // blocksize] ) )                           high nibble first

bitsandbytes' kernels multiply with flush-to-zero (a subnormal product becomes a zero of the same
sign; its ``absmax += offset`` is a torch add and keeps subnormals), so the products are flushed here
too. Each torch operation rounds once (a multiply and a separate add are never fused on the CPU), and
``Tensor.copy_`` to fp16/bf16 rounds to nearest even. bitsandbytes' own CPU op is not used: at
blocksize >= 2048 on AVX512 machines, and for an odd last dimension, it falls back to a pure-torch path
that decodes FP4 nibble 8 as +0.0 where its CUDA kernel (the truth) gives -0.0.

Work goes in chunks of whole quant blocks, so the fp32 scratch is bounded by the chunk, not the weight.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 1 << 22  # packed bytes per chunk: 32 MiB of fp32 scratch
FLT_MIN = 1.1754943508222875e-38  # smallest normal fp32
# |code| >= 0.0052 for every non-zero entry (NF4 0.0796, FP4 1/192 and up): a product can only be
# subnormal where |scale| is below FLT_MIN / 0.0052, so only such chunks pay for the flush.
TINY_SCALE = FLT_MIN / 0.005

_pair_tables: dict = {}


def _pair_table(code: torch.Tensor) -> torch.Tensor:
    """[256, 2] fp32: the values of the high and low nibble of every byte, one gather per byte."""
    key = (code.data_ptr(), code.device, code._version)
    table = _pair_tables.get(key)
    if table is None:
        byte = torch.arange(256, device=code.device)
        table = torch.stack((code[byte >> 4], code[byte & 15]), dim=1).contiguous()
        _pair_tables.clear()
        _pair_tables[key] = table
    return table


def decode_absmax(absmax, code2, absmax2, offset, nested_blocksize) -> torch.Tensor:
    """The fp32 scale of every quant block (two roundings when nested, like bitsandbytes)."""
    if code2 is None:
        return absmax.float()
    scale = code2[absmax.long()]
    scale = flush_subnormal(scale * absmax2.repeat_interleave(nested_blocksize)[: absmax.numel()])
    scale += offset
    return scale


def flush_subnormal(values: torch.Tensor) -> torch.Tensor:
    """Subnormal values to zeros of the same sign (x * 0.0 keeps the sign), in place."""
    tiny = values.abs() < FLT_MIN
    if tiny.any():
        values[tiny] = values[tiny] * 0.0
    return values


def dequantize(packed, absmax, code2, absmax2, offset, code, out, blocksize, nested_blocksize):
    """Dequantize the 1-D uint8 ``packed`` into the contiguous ``out``; inputs are trusted here."""
    n_elements = out.numel()
    flat_out = out.view(-1)
    scale = decode_absmax(absmax, code2, absmax2, offset, nested_blocksize)
    pairs = _pair_table(code)
    half_block = blocksize // 2
    chunk = max(half_block, CHUNK_BYTES // half_block * half_block)
    n_bytes = packed.numel()
    for first_byte in range(0, n_bytes, chunk):
        last_byte = min(first_byte + chunk, n_bytes)
        values = torch.index_select(pairs, 0, packed[first_byte:last_byte].int()).view(-1)  # [2 * bytes] fp32
        first_element = 2 * first_byte
        count = min(values.numel(), n_elements - first_element)
        first_block = first_byte // half_block
        full_blocks = count // blocksize
        target = flat_out[first_element : first_element + count]
        if full_blocks:
            full = full_blocks * blocksize
            block_values = values[:full].view(full_blocks, blocksize)
            block_scale = scale[first_block : first_block + full_blocks]
            block_values *= block_scale[:, None]
            if block_scale.abs().min() < TINY_SCALE:
                flush_subnormal(values[:full])
            target[:full].copy_(values[:full])
        rest = count - full_blocks * blocksize
        if rest:  # the partial last block of the weight
            start = full_blocks * blocksize
            tail = flush_subnormal(values[start : start + rest] * scale[first_block + full_blocks])
            target[start:].copy_(tail)
    return out
