"""The exact CPU path: the same arithmetic as kernels/nf4.py, in numpy (the converter's CPU route runs without importing
torch, seconds of start-up with torch's CUDA build; only fp16 results take torch's conversion: :func:`uses_torch`).

    A[k]   = fl32( fl32( code2[absmax_u8[k]] * absmax2[k // nested_blocksize] ) + offset )   nested
    out[e] = round_T( fl32( code[nibble(e)] * A[e // blocksize] ) )                           high nibble first

bitsandbytes' kernels multiply with flush-to-zero (``mul.ftz.f32``, built with fast math: a subnormal
operand reads as a zero of its sign, and a product is flushed to a zero of its sign when it is below
FLT_MIN *after rounding to 24 bits with an unbounded exponent*, so a product just under FLT_MIN that
would round up to FLT_MIN is flushed too; its ``absmax += offset`` is a torch add and keeps subnormals),
so the products are flushed the same way here: :func:`ftz_multiply`. Each numpy operation rounds once (a multiply
and a separate add are never fused), and :func:`store` rounds fp32 to fp16/bf16 to nearest even, as CUDA's
``__float2half_rn`` / ``__float2bfloat16_rn`` do; a NaN becomes the canonical NaN CUDA makes (all ones but the
sign), so the CPU and GPU routes agree on every bit. bitsandbytes' own CPU op is not used: it decodes FP4
nibble 8 as +0.0 where its CUDA kernel (the truth) gives -0.0, and how else it departs depends on the CPU (on
AVX512 machines a per-row absmax in some cases; on Intel CPUs with AVX512-FP16, fp16 results that differ from
CUDA's in about 1 element of 5000).

Work goes in chunks of whole quant blocks, through one reused fp32 scratch of a chunk: gathered, scaled, rounded.
Each pass is one numpy call, which lets go of Python's lock; a chunk that stays in a core's L2 cache between the
passes keeps memory traffic to the packed bytes in and the output out: chunks of ``CHUNK_BYTES`` packed bytes were
about twice as fast as chunks of megabytes, and smaller ones lost on two threads, where the calls wait on the lock
(benchmarks/bench_cpu_scaling.py). A worker process (the CPU
route's, workers.py) has no one to share the lock with and takes ``PROCESS_CHUNK_BYTES`` as its ``CHUNK_BYTES``.

Casts of plain tensors (:func:`cast`) live here too: every float conversion of the converter is this module's.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from ..dtypes import BY_NAME, DTYPES, to_float32

CHUNK_BYTES = 1 << 17  # packed bytes per chunk: 1 MiB of fp32 scratch
PROCESS_CHUNK_BYTES = 1 << 15  # in a worker process: 256 KiB of fp32 scratch
FLT_MIN = 1.1754943508222875e-38  # smallest normal fp32
LIFT = 2.0**24  # x * 2^24 is normal wherever round24(x) could be, so fp32 rounds it with the unbounded exponent
# |code| >= 0.0052 for every non-zero entry (NF4 0.0796, FP4 1/192 and up): a product can only be
# (near) subnormal where |scale| is below FLT_MIN / 0.005, so only such chunks pay for the flush.
TINY_SCALE = FLT_MIN / 0.005

# CUDA's canonical NaN of each float dtype (safetensors' names)
CANONICAL_NAN = {"F32": 0x7FFFFFFF, "F16": 0x7FFF, "BF16": 0x7FFF}  # the output dtypes'
_INTEGER = {4: np.uint32, 2: np.uint16}

_quad_tables: dict = {}


def _quad_table(code: np.ndarray) -> np.ndarray:
    """[65536, 4] fp32 table: the four values of every pair of bytes, read as one little-endian uint16 (low byte
    first). numpy's take with uint16 indices is one gather per two bytes, and the 1 MiB table stays in cache."""
    key = code.tobytes()
    table = _quad_tables.get(key)
    if table is None:
        values = code.astype(np.float32)
        word = np.arange(65536)
        first, second = word & 255, word >> 8
        table = np.stack((values[first >> 4], values[first & 15], values[second >> 4], values[second & 15]), axis=1)
        _quad_tables.clear()
        _quad_tables[key] = table = np.ascontiguousarray(table, dtype=np.float32)
    return table


def _decode_nibbles(table: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """fp32 [2 * bytes]: code[high nibble], code[low nibble] of every byte, in order."""
    even = raw.size // 2 * 2
    values = np.empty(2 * raw.size, dtype=np.float32)
    # mode="clip": every uint16 is a valid index, and "raise" would buffer the output (a copy)
    np.take(table, raw[:even].view(np.uint16), axis=0, out=values[: 2 * even].reshape(-1, 4), mode="clip")
    if even < raw.size:  # an odd byte count: the last byte alone, paired with a zero byte
        values[2 * even :] = table[int(raw[-1])][:2]
    return values


def decode_absmax(absmax, code2, absmax2, offset, nested_blocksize) -> np.ndarray:
    """The fp32 scale of every quant block (two roundings when nested, like bitsandbytes). ``absmax``: uint8 codes
    when nested (``code2``, ``absmax2`` fp32 arrays, ``offset`` a float), else the fp32 scales themselves."""
    if code2 is None:
        return np.asarray(absmax, dtype=np.float32)
    with np.errstate(all="ignore"):
        scale = np.asarray(code2, dtype=np.float32)[absmax]
        ftz_multiply(scale, np.repeat(np.asarray(absmax2, dtype=np.float32), nested_blocksize)[: absmax.size])
        scale += np.float32(offset)
    return scale


def ftz_multiply(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``values *= scale`` in place as CUDA's ``mul.ftz.f32``: subnormal operands read as zeros of their sign,
    and a product whose 24-bit rounding (unbounded exponent) is below FLT_MIN becomes a zero of its sign."""
    with np.errstate(all="ignore"):
        values[np.abs(values) < FLT_MIN] *= np.float32(0.0)  # x * 0.0 keeps the sign
        scale = np.where(np.abs(scale) < FLT_MIN, scale * np.float32(0.0), scale)
        # Lifted by 2^24 (exact: a power of two) the product is normal wherever it matters, so fp32 rounds it
        # with 24 bits; where that lifted product is below FLT_MIN * 2^24 the unlifted one is flushed.
        tiny = np.abs(values * (scale * np.float32(LIFT))) < np.float32(FLT_MIN * LIFT)
        values *= scale
        values[tiny] *= np.float32(0.0)
    return values


def uses_torch(dtype: str) -> bool:
    """Whether storing ``dtype`` takes torch: fp16, whose conversion numpy makes one element at a time (many times
    slower than torch's vectorized one, most on fp16 subnormals: benchmarks/bench_fp16_cast.py); bf16 and fp32 are
    numpy's own work (:func:`store`)."""
    return dtype == "F16"


def store(values: np.ndarray, out: np.ndarray, dtype: str, nan: bool = True, scratch: np.ndarray | None = None) -> None:
    """fp32 ``values`` into ``out`` (a numpy array of ``DTYPES[dtype].numpy``, as many elements), rounded to nearest
    even; ``nan``: ``values`` may hold NaNs (each becomes ``CANONICAL_NAN[dtype]``); ``scratch``: uint32 room for
    bf16."""
    if dtype == "BF16":  # round to nearest even on the bits: add 0x7FFF and the kept part's last bit, keep the top half
        bits = values.view(np.uint32)
        carry = np.empty(values.size, dtype=np.uint32) if scratch is None else scratch[: values.size]
        np.right_shift(bits, 16, out=carry)
        np.bitwise_and(carry, 1, out=carry)
        np.add(carry, 0x7FFF, out=carry)
        np.add(carry, bits, out=carry)
        np.copyto(out, carry.view(np.uint16)[1::2])  # the high half of each (little-endian)
    elif uses_torch(dtype):
        import torch

        torch.from_numpy(out).copy_(torch.from_numpy(values))  # vcvtps2ph: round to nearest even, subnormals kept
    else:
        np.copyto(out, values)
    if nan:
        where = np.isnan(values)
        if where.any():
            out.view(_INTEGER[out.itemsize])[where] = CANONICAL_NAN[dtype]


def dequantize(packed, absmax, code2, absmax2, offset, code, out, dtype: str, blocksize: int, nested_blocksize: int):
    """Dequantize the 1-D uint8 array ``packed`` into ``out`` (uint8 bytes of ``dtype``: "BF16", "F16" or "F32");
    ``code`` the fp32 [16] table; the quant state as :func:`decode_absmax` takes it. Inputs are trusted here."""
    target = out.view(DTYPES[dtype].numpy)
    n_elements = target.size
    scale = decode_absmax(absmax, code2, absmax2, offset, nested_blocksize)
    nan = not bool(np.isfinite(scale).all())  # a NaN or infinite scale makes NaNs (inf * 0): canonical, as CUDA's
    table = _quad_table(np.asarray(code, dtype=np.float32))
    half_block = blocksize // 2
    full_blocks = n_elements // blocksize
    with np.errstate(all="ignore"):
        if full_blocks:  # whole blocks: an even number of bytes, every chunk a whole number of uint16 words
            n_full = full_blocks * blocksize
            chunk = max(half_block, CHUNK_BYTES // half_block * half_block)  # packed bytes per pass
            scratch = np.empty(min(2 * chunk, n_full), dtype=np.float32)
            rounding = np.empty(scratch.size, dtype=np.uint32) if dtype == "BF16" else None
            quads = scratch.reshape(-1, 4)
            words = packed[: n_full // 2].view(np.uint16)
            block_scales = scale[:full_blocks, None]
            tiny = bool((np.abs(scale[:full_blocks]) < TINY_SCALE).any())  # not min(): a NaN would hide a tiny one
            for first in range(0, n_full, 2 * chunk):
                count = min(2 * chunk, n_full - first)
                # mode="clip": every uint16 is a valid index, and "raise" would buffer the output (a copy)
                np.take(table, words[first // 4 : (first + count) // 4], axis=0, out=quads[: count // 4], mode="clip")
                values = scratch[:count].reshape(-1, blocksize)
                chunk_scales = block_scales[first // blocksize : (first + count) // blocksize]
                if tiny and (np.abs(chunk_scales) < TINY_SCALE).any():
                    ftz_multiply(values, chunk_scales)
                else:
                    np.multiply(values, chunk_scales, out=values)
                store(scratch[:count], target[first : first + count], dtype, nan, rounding)
        rest = n_elements - full_blocks * blocksize
        if rest:  # the partial last block of the weight (an odd byte count ends here)
            start = full_blocks * blocksize
            values = _decode_nibbles(table, packed[start // 2 :])[:rest]
            store(ftz_multiply(values, scale[full_blocks : full_blocks + 1]), target[start:], dtype, nan)
    return out


def _torch_loaded() -> bool:
    return sys.modules.get("torch") is not None


def cast(source: np.ndarray, source_dtype: str, out: np.ndarray, dtype: str) -> None:
    """Plain tensor bytes of float ``source_dtype`` into ``out`` (bytes of float ``dtype``), as torch's CPU casts
    round every number; a NaN becomes ``CANONICAL_NAN[dtype]`` (torch's NaN bits depend on the CPU). Where torch is
    imported already (the CUDA route, a plan that needs it) or the target is fp16, torch's own cast does it, straight
    from the source dtype: one pass, several times faster than numpy's, and on torch's threads where the caller has
    them (the CUDA route's one maker thread); the bits are the same either way (tests/test_casts.py)."""
    if uses_torch(dtype) or _torch_loaded():
        import torch

        target = torch.from_numpy(out).view(DTYPES[dtype].torch)
        target.copy_(torch.from_numpy(source).view(DTYPES[source_dtype].torch))
        if math.isnan(
            float(target.sum())
        ):  # a NaN makes the sum NaN (so may inf - inf): one pass, much cheaper than isnan
            nan = target.isnan()
            target.view({2: torch.int16, 4: torch.int32}[target.element_size()])[nan] = CANONICAL_NAN[dtype]
        return
    store(to_float32(source, source_dtype), out.view(DTYPES[dtype].numpy), dtype)


def dequantize_tensors(
    packed, absmax, code2, absmax2, offset, code, out, blocksize: int, nested_blocksize: int
) -> None:
    """:func:`dequantize` on CPU tensors (the public function's and the compiled op's CPU path): ``packed`` contiguous
    bytes into contiguous ``out``."""
    import torch

    def array(tensor):
        return None if tensor is None else tensor.detach().contiguous().numpy()

    dequantize(
        packed.detach().reshape(-1).view(torch.uint8).numpy(),
        array(absmax),
        array(code2),
        array(absmax2),
        None if offset is None else float(offset),
        array(code),
        out.detach().view(-1).view(torch.uint8).numpy(),
        BY_NAME[str(out.dtype).removeprefix("torch.")].code,
        blocksize,
        nested_blocksize,
    )
