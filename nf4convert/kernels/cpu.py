"""The exact CPU path: the same arithmetic as kernels/nf4.py, in torch operations.

    A[k]   = fl32( fl32( code2[absmax_u8[k]] * absmax2[k // nested_blocksize] ) + offset )   nested
    out[e] = round_T( fl32( code[nibble(e)] * A[e // blocksize] ) )                           high nibble first

bitsandbytes' kernels multiply with flush-to-zero (``mul.ftz.f32``, built with fast math: a subnormal
operand reads as a zero of its sign, and a product is flushed to a zero of its sign when it is below
FLT_MIN *after rounding to 24 bits with an unbounded exponent*, so a product just under FLT_MIN that
would round up to FLT_MIN is flushed too; its ``absmax += offset`` is a torch add and keeps subnormals),
so the products are flushed the same way here: :func:`ftz_multiply`. Each torch operation rounds once (a multiply and a separate add are never fused on the CPU), and
``Tensor.copy_`` to fp16/bf16 rounds to nearest even. bitsandbytes' own CPU op is not used: it decodes FP4
nibble 8 as +0.0 where its CUDA kernel (the truth) gives -0.0, and how else it departs depends on the CPU (on
AVX512 machines a per-row absmax in some cases; on Intel CPUs with AVX512-FP16, fp16 results that differ from
CUDA's in about 1 element of 5000).

Work goes in chunks of whole quant blocks, through one reused fp32 scratch of a chunk: gathered, scaled, cast.
How large a chunk is best depends on who else decodes. Threads of one process take the interpreter's lock back
after each call, so their chunks are large (few calls; on the H200 machine's 16 cores, 16 threads made 3.6-4.1 GB/s
of bf16 at 4 MiB chunks and 1.4 at 128 KiB: benchmarks/bench_cpu_scaling.py). A process of its own (the CPU route's
worker processes, workers.py) has no one to wait for, and there a chunk small enough to stay in the core's L2 cache
between its three passes keeps memory to the packed bytes in and the output out, leaving the memory bus to the
writers beside it: ``PROCESS_CHUNK_BYTES``, which each worker takes as its ``CHUNK_BYTES``.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 1 << 22  # packed bytes per chunk on threads: 32 MiB of fp32 scratch
PROCESS_CHUNK_BYTES = 1 << 15  # in a worker process: 256 KiB of fp32 scratch, in a core's L2 cache
FLT_MIN = 1.1754943508222875e-38  # smallest normal fp32
LIFT = 2.0**24  # x * 2^24 is normal wherever round24(x) could be, so fp32 rounds it with the unbounded exponent
# |code| >= 0.0052 for every non-zero entry (NF4 0.0796, FP4 1/192 and up): a product can only be
# (near) subnormal where |scale| is below FLT_MIN / 0.005, so only such chunks pay for the flush.
TINY_SCALE = FLT_MIN / 0.005

_quad_tables: dict = {}


def _quad_table(code: torch.Tensor):
    """[65536, 4] fp32 numpy table: the four values of every pair of bytes, read as one little-endian
    uint16 (low byte first). numpy's take with uint16 indices is one gather per two bytes, several
    times faster than torch's indexing on the CPU, and the 1 MiB table stays in cache."""
    import numpy as np

    key = (code.data_ptr(), code._version)
    table = _quad_tables.get(key)
    if table is None:
        values = code.cpu().numpy()
        word = np.arange(65536)
        first, second = word & 255, word >> 8
        table = np.stack((values[first >> 4], values[first & 15], values[second >> 4], values[second & 15]), axis=1)
        _quad_tables.clear()
        _quad_tables[key] = table = np.ascontiguousarray(table, dtype=np.float32)
    return table


def _decode_nibbles(table, packed: torch.Tensor) -> torch.Tensor:
    """fp32 [2 * bytes]: code[high nibble], code[low nibble] of every byte, in order."""
    import numpy as np

    raw = packed.numpy()
    even = raw.size // 2 * 2
    values = np.empty(2 * raw.size, dtype=np.float32)
    # mode="clip": every uint16 is a valid index, and "raise" would buffer the output (a copy)
    np.take(table, raw[:even].view(np.uint16), axis=0, out=values[: 2 * even].reshape(-1, 4), mode="clip")
    if even < raw.size:  # an odd byte count: the last byte alone, paired with a zero byte
        values[2 * even :] = table[int(raw[-1])][:2]
    return torch.from_numpy(values)


def decode_absmax(absmax, code2, absmax2, offset, nested_blocksize) -> torch.Tensor:
    """The fp32 scale of every quant block (two roundings when nested, like bitsandbytes)."""
    if code2 is None:
        return absmax.float()
    scale = code2[absmax.long()]
    ftz_multiply(scale, absmax2.repeat_interleave(nested_blocksize)[: absmax.numel()])
    scale += offset
    return scale


def ftz_multiply(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``values *= scale`` in place as CUDA's ``mul.ftz.f32``: subnormal operands read as zeros of their sign,
    and a product whose 24-bit rounding (unbounded exponent) is below FLT_MIN becomes a zero of its sign."""
    values.copy_(torch.where(values.abs() < FLT_MIN, values * 0.0, values))
    scale = torch.where(scale.abs() < FLT_MIN, scale * 0.0, scale)
    # Lifted by 2^24 (exact: a power of two) the product is normal wherever it matters, so fp32 rounds it
    # with 24 bits; where that lifted product is below FLT_MIN * 2^24 the unlifted one is flushed.
    tiny = (values * (scale * LIFT)).abs() < FLT_MIN * LIFT
    values *= scale
    if tiny.any():
        values[tiny] = values[tiny] * 0.0  # x * 0.0 keeps the sign
    return values


def dequantize(packed, absmax, code2, absmax2, offset, code, out, blocksize, nested_blocksize):
    """Dequantize the 1-D uint8 ``packed`` into the contiguous ``out``; inputs are trusted here."""
    import numpy as np

    n_elements = out.numel()
    flat_out = out.view(-1)
    scale = decode_absmax(absmax, code2, absmax2, offset, nested_blocksize)
    table = _quad_table(code)
    half_block = blocksize // 2
    full_blocks = n_elements // blocksize
    if full_blocks:  # whole blocks: an even number of bytes, every chunk a whole number of uint16 words
        n_full = full_blocks * blocksize
        chunk = max(half_block, CHUNK_BYTES // half_block * half_block)  # packed bytes per pass
        scratch = torch.empty(min(2 * chunk, n_full), dtype=torch.float32)
        quads = scratch.numpy().reshape(-1, 4)
        words = packed[: n_full // 2].numpy().view(np.uint16)
        block_scales = scale[:full_blocks, None]
        tiny = bool((scale[:full_blocks].abs() < TINY_SCALE).any())  # not min(): a NaN scale would hide a tiny one
        for first in range(0, n_full, 2 * chunk):
            count = min(2 * chunk, n_full - first)
            # mode="clip": every uint16 is a valid index, and "raise" would buffer the output (a copy)
            np.take(table, words[first // 4 : (first + count) // 4], axis=0, out=quads[: count // 4], mode="clip")
            values = scratch[:count].view(-1, blocksize)
            chunk_scales = block_scales[first // blocksize : (first + count) // blocksize]
            if tiny and (chunk_scales.abs() < TINY_SCALE).any():
                ftz_multiply(values, chunk_scales)
            else:
                values.mul_(chunk_scales)
            flat_out[first : first + count].copy_(scratch[:count])
    rest = n_elements - full_blocks * blocksize
    if rest:  # the partial last block of the weight (an odd byte count ends here)
        start = full_blocks * blocksize
        values = _decode_nibbles(table, packed[start // 2 :])[:rest]
        flat_out[start:].copy_(ftz_multiply(values, scale[full_blocks]))
    return out
