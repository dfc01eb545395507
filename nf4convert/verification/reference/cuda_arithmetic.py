"""The reference for ``verify``: bitsandbytes' 4-bit dequantization, exactly as its CUDA kernels compute it.

On a CUDA device the reference *is* bitsandbytes: ``bitsandbytes.functional.dequantize_4bit``, whose CUDA
kernels are the truth this project is held to. On the CPU it is a plain torch computation built from
bitsandbytes' own parts (its 4-bit tables, the quant state it parsed) that reproduces those kernels bit
for bit. Nothing here imports ``nf4convert.kernels`` or ``nf4convert.dequantize``: the reference must not
share code (or mistakes) with what it checks.

Why not bitsandbytes' CPU ops? They are not the CUDA arithmetic: on AVX512 machines the native 4-bit op
indexes absmax per row (wrong when a row is not a whole number of blocks); its AVX512 and pure-torch
fallback paths decode FP4 nibble 8 as +0.0 (its plain C++ loop gives -0.0, so the sign depends on the
host); on CPUs with AVX512-FP16 its fp16 results were seen to differ from CUDA in about 1 element of 5000;
and its native 8-bit op (``dequantize_blockwise``, used for the nested absmax) keeps subnormal products
that CUDA flushes. So the CPU reference calls none of them, and computes, per element ``e`` of block ``k``:

    A[k]   = fl32( ftz( code2[absmax_u8[k]] * absmax2[k >> log2(nested_blocksize)] ) + offset )   (nested)
    A[k]   = absmax[k]                                                                              (flat)
    out[e] = round_T( ftz( code[nibble(e)] * A[e // blocksize] ) ),   nibble(2i) = byte[i] >> 4

Each step and why (read in bitsandbytes' csrc/kernels.cu, kDequantizeBlockwise, and ops.cu):

- ``code`` is ``bitsandbytes.functional.get_4bit_type`` (bit-identical to the kernels' constant tables
  ``nf4_dequantization_lut`` / ``fp4_dequantization_lut``), with FP4 entry 8 set to -0.0: the kernel
  decodes FP4 as ``lut[v & 7] * (1 - 2 * (v >> 3))``, so nibble 8 is ``0.0f * -1.0f = -0.0``. The
  checkpoint's stored ``quant_map`` is ignored, as the kernels ignore it.
- The high nibble of each byte is the first element; the odd last element of an odd count is the high
  nibble of the last byte.
- ``ftz``: bitsandbytes builds its CUDA code with ``--use_fast_math``, so every ``float * float`` is
  ``mul.ftz.f32``: subnormal operands are read as zeros of their sign, and a result is flushed to a zero
  of its sign when it is tiny *after rounding to 24 bits with an unbounded exponent*. Measured on an H100
  with products crafted just below FLT_MIN: a product in [FLT_MIN - 2^-150, FLT_MIN - 2^-151) is flushed
  (a plain "round, then flush subnormals" would keep it as FLT_MIN), one in [FLT_MIN - 2^-151, FLT_MIN)
  is kept as FLT_MIN. This rounding is computed exactly here by lifting the product by 2^24 into the
  normal range, where fp32 rounding is the unbounded one. The nested absmax is the 8-bit instance of the
  same kernel (General8bit, fp32 out), so its products flush the same way.
- ``+ offset`` is bitsandbytes' ``absmax += quant_state.offset``, a torch add of its own (no FMA with the
  product, no flush: torch's CUDA kernels are not built with fast math), in fp32.
- A NaN (a NaN scale, or an infinite one times a zero code) is CUDA's canonical NaN: all bits but the sign set.
- No FMA anywhere: each product is stored before anything else touches it. ``round_T`` is the one
  conversion of the fp32 product to the output dtype, round to nearest even (``__float2half_rn``,
  ``__float2bfloat16_rn`` in CUDA, ``Tensor.copy_`` here, which keeps fp16 subnormals as CUDA does).

The CPU work goes in chunks of whole quant blocks (``CHUNK_ELEMENTS``) through one fp32 scratch per thread, kept
for the thread's next call, so memory stays bounded: the output, its blocks' scales (4 bytes a block) and the
scratch. Each chunk takes few calls (the lookup, then the product rounded to fp32 and to the output dtype in one
torch call): several threads can share the cores, each waiting little on Python's lock. Torch's default gradual
underflow is assumed (``torch.set_flush_denormal(False)``): only the offset add depends on it.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any, Mapping

import torch

from ...errors import ArgumentError

CHUNK_ELEMENTS = 1 << 20  # elements per CPU chunk (rounded down to whole blocks): 4 MiB of fp32 scratch
FLT_MIN = 2.0**-126  # smallest normal fp32
_LIFT = 2.0**24  # x * 2^24 is normal whenever round24(x) can be normal, so fp32 rounds it with 24 bits
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dequantize_4bit(
    packed: torch.Tensor, quant_state: Any, *, dtype: torch.dtype, device, out: torch.Tensor | None = None
) -> torch.Tensor:
    """What bitsandbytes' CUDA kernels give for ``packed``, as a tensor of ``quant_state.shape`` and ``dtype``.

    ``quant_state`` is a ``bitsandbytes.functional.QuantState`` (or anything with its fields), on any
    device; ``packed`` is the packed weight in any storage dtype (read as bytes). On a CUDA ``device`` this
    runs ``bitsandbytes.functional.dequantize_4bit`` there (the caller's state is not modified); on the
    CPU, the exact computation described in this module's docstring, into ``out`` where given (CPU memory of at
    least the result's bytes, any dtype: a caller's reused buffer).

        >>> packed, state = F.quantize_4bit(weight.cuda(), quant_type="nf4", compress_statistics=True)
        >>> dense = dequantize_4bit(packed.cpu(), cpu_state, dtype=torch.bfloat16, device="cpu")

    Raises ValueError for a quant state that bitsandbytes could not have written (it says what is wrong).
    """
    device = torch.device(device)
    raw = _as_bytes(packed)
    check(raw.numel(), quant_state, dtype)
    if device.type == "cuda":
        return _dequantize_cuda(raw, quant_state, dtype, device)
    if device.type != "cpu":
        raise ArgumentError(f"device {device} is not supported: the reference runs on cpu or cuda")
    return _dequantize_cpu(raw.cpu(), quant_state, dtype, out)


def quant_state_from_tensors(tensors: Mapping[str, torch.Tensor], device, *, file: str | None = None):
    """``bitsandbytes.functional.QuantState.from_dict`` over one weight's checkpoint tensors.

    ``tensors`` maps the weight's quant-state keys (``<name>.absmax``, ``<name>.quant_map``,
    ``<name>.nested_absmax``, ``<name>.nested_quant_map``, ``<name>.quant_state.bitsandbytes__nf4``) to
    tensors. A state bitsandbytes cannot read raises CheckpointError naming the weight (and ``file``).
    """
    import bitsandbytes.functional as F

    from ...errors import CheckpointError

    # the weight's name: every key is "<name>.<part>", the packed JSON one "<name>.quant_state.bitsandbytes__nf4"
    names = sorted(
        {key.partition(".quant_state.")[0] if ".quant_state." in key else key.rpartition(".")[0] for key in tensors}
    )
    where = f"{file}: " if file else ""
    weight = ", ".join(names) or "(no tensors)"
    try:
        state = F.QuantState.from_dict(dict(tensors), device=torch.device(device))  # from_dict pops from its dict
    except (KeyError, AssertionError, ValueError, TypeError, AttributeError) as error:  # JSON errors are ValueErrors
        if isinstance(error, KeyError):
            detail = f"no {error}"
        elif isinstance(error, AssertionError):
            detail = f"keys other than {sorted(F.QuantState.valid_qs_keys)}"
        else:
            detail = (str(error).splitlines() or [type(error).__name__])[0]
        raise CheckpointError(f"{where}{weight}: bitsandbytes cannot read its quant state ({detail})") from None
    if not state.nested and not state.absmax.is_floating_point():  # from_dict reads a lost nested_absmax as "flat"
        raise CheckpointError(
            f"{where}{weight}: absmax is {state.absmax.dtype} (double-quantized) but there is no nested_absmax"
        )
    return state


def _as_bytes(packed: torch.Tensor) -> torch.Tensor:
    """The packed weight as a flat uint8 tensor (bf16/fp32/... storage too, as FSDP-QLoRA writes it)."""
    return packed.detach().contiguous().view(torch.uint8).reshape(-1)


def check(n_bytes: int, quant_state: Any, dtype: torch.dtype) -> None:
    if dtype not in OUT_DTYPES:
        raise ArgumentError(f"dtype must be float16, bfloat16 or float32, not {dtype}")
    if quant_state.quant_type not in ("nf4", "fp4"):
        raise ArgumentError(f"quant_type must be 'nf4' or 'fp4', not {quant_state.quant_type!r}")
    if quant_state.blocksize not in BLOCKSIZES:
        raise ArgumentError(f"blocksize must be one of {BLOCKSIZES}, not {quant_state.blocksize!r}")
    n_elements = math.prod(quant_state.shape)
    if n_bytes != (n_elements + 1) // 2:
        raise ArgumentError(
            f"{n_bytes} packed bytes do not hold shape {tuple(quant_state.shape)} ({(n_elements + 1) // 2} expected)"
        )
    n_blocks = -(-n_elements // quant_state.blocksize)
    if quant_state.absmax.numel() != n_blocks:
        raise ArgumentError(f"absmax has {quant_state.absmax.numel()} entries, {n_blocks} expected")
    if not quant_state.nested:
        if not quant_state.absmax.is_floating_point():
            raise ArgumentError(f"absmax must be floating point without a nested state, not {quant_state.absmax.dtype}")
        return
    state2 = quant_state.state2
    if quant_state.absmax.dtype != torch.uint8:
        raise ArgumentError(f"nested absmax must be uint8, not {quant_state.absmax.dtype}")
    if getattr(state2, "dtype", torch.float32) != torch.float32:
        raise ArgumentError(f"nested dtype must be float32 (what bitsandbytes writes), not {state2.dtype}")
    blocksize2 = state2.blocksize
    if not isinstance(blocksize2, int) or blocksize2 <= 0 or blocksize2 & (blocksize2 - 1):
        raise ArgumentError(f"nested blocksize must be a power of two, not {blocksize2!r}")
    if state2.absmax.numel() != -(-n_blocks // blocksize2):
        raise ArgumentError(f"nested absmax has {state2.absmax.numel()} entries, {-(-n_blocks // blocksize2)} expected")
    if state2.code.numel() != 256:
        raise ArgumentError(f"nested quant map has {state2.code.numel()} entries, 256 expected")
    if quant_state.offset is None or torch.as_tensor(quant_state.offset).numel() != 1:
        raise ArgumentError("nested quant state has no single offset")


def _dequantize_cuda(raw: torch.Tensor, quant_state: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    import copy

    import bitsandbytes.functional as F

    state = copy.copy(quant_state)  # the caller's state keeps its device and dtype
    state.dtype = dtype  # bitsandbytes rounds its fp32 products straight to the dtype asked for
    state.absmax = quant_state.absmax.to(device)
    if quant_state.nested:
        state.offset = torch.as_tensor(quant_state.offset, dtype=torch.float32).to(device)
        state.state2 = copy.copy(quant_state.state2)
        state.state2.absmax = quant_state.state2.absmax.to(device)
        state.state2.code = quant_state.state2.code.to(device)
    # [bytes, 1], as bitsandbytes stores it: a [1, k] input would be taken for its old transposed form
    dense = F.dequantize_4bit(raw.to(device).reshape(-1, 1), state)
    return dense.reshape(quant_state.shape)


def _flush_operand(values: torch.Tensor) -> torch.Tensor:
    """fp32 ``values`` with subnormals read as zeros of their sign, as ``mul.ftz`` reads its operands."""
    values = values.float()
    return torch.where(values.abs() < FLT_MIN, values * 0.0, values)


def _multiply_ftz(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``values * scale`` in place as CUDA's ``mul.rn.ftz.f32`` (operands already flushed).

    A product is flushed to a zero of its sign when, rounded to 24 bits with an unbounded exponent, it is
    below FLT_MIN. ``values * (scale * 2^24)`` is that rounding, lifted: scaling a normal ``scale`` by
    2^24 is exact (an overflow to inf only marks a product far too large to flush), and a lifted product
    that could be normal unlifted lies in fp32's normal range, where rounding keeps 24 bits.
    """
    lifted = values * (scale * _LIFT)
    values.mul_(scale)
    tiny = lifted.abs() < FLT_MIN * _LIFT
    values[tiny] = values[tiny] * 0.0
    return values


def _block_scales(quant_state: Any, first_block: int, last_block: int, operands: dict) -> torch.Tensor:
    """fp32 scales of quant blocks ``[first_block, last_block)``, flushed as the 4-bit multiply reads them.

    (With |code| <= 1 a subnormal scale only makes products the flush would zero anyway; reading it as
    zero says what CUDA does. In the nested decode the operand flush matters: code2 is data.)
    """
    if not quant_state.nested:
        return _flush_operand(quant_state.absmax[first_block:last_block].cpu())
    code2, absmax2, offset, shift = operands["code2"], operands["absmax2"], operands["offset"], operands["shift"]
    quantized = quant_state.absmax[first_block:last_block].cpu().long()
    nested_block = torch.arange(first_block, last_block) >> shift
    # index_select, not code2[quantized]: torch's advanced indexing is far slower on the CPU
    scale = _multiply_ftz(code2.index_select(0, quantized), absmax2.index_select(0, nested_block))
    scale += offset  # bitsandbytes' `absmax += offset`: its own fp32 add, after the flushed product
    return _flush_operand(scale)


@functools.lru_cache(maxsize=None)
def _pair_table(quant_type: str):
    """numpy fp32 [256, 2]: the CUDA code of the high and the low nibble of every byte."""
    import bitsandbytes.functional as F
    import numpy as np

    code = F.get_4bit_type(quant_type, device="cpu").float().clone()
    if quant_type == "fp4":
        code[8] = -0.0  # CUDA: lut[0] * (1 - 2 * 1) = 0.0f * -1.0f; bitsandbytes' table holds +0.0
    values = code.numpy()
    byte = np.arange(256)
    table = np.ascontiguousarray(np.stack((values[byte >> 4], values[byte & 15]), axis=1), dtype=np.float32)
    table.flags.writeable = False  # shared by every call
    return table


def _dequantize_cpu(raw: torch.Tensor, quant_state: Any, dtype: torch.dtype, out=None) -> torch.Tensor:
    import numpy as np

    shape = torch.Size(quant_state.shape)
    n_elements = shape.numel()
    blocksize = quant_state.blocksize
    n_blocks = -(-n_elements // blocksize)
    if out is None:
        out = torch.empty(n_elements, dtype=dtype)
    else:
        out = out.view(-1).view(torch.uint8)[: n_elements * dtype.itemsize].view(dtype)
    pairs = _pair_table(quant_state.quant_type)
    operands = {}
    if quant_state.nested:
        state2 = quant_state.state2
        operands = {
            "code2": _flush_operand(state2.code.cpu()),
            "absmax2": _flush_operand(state2.absmax.cpu()),
            "offset": torch.as_tensor(quant_state.offset, dtype=torch.float32).cpu().reshape(()),
            "shift": state2.blocksize.bit_length() - 1,  # CUDA indexes by shift: k >> log2(blocksize)
        }
    scales = _block_scales(quant_state, 0, n_blocks, operands)  # 4 bytes a block, in one pass of few calls
    # |code| >= 1/192 for every non-zero entry, so a block whose |scale| is at least this has no product
    # near FLT_MIN and skips the flush (with a margin: the products then exceed 2 * FLT_MIN).
    smallest_code = float(np.abs(pairs[pairs != 0]).min())
    no_flush_scale = 2 * FLT_MIN / smallest_code
    tiny = bool((scales.abs() < no_flush_scale).any())  # not min(): a NaN scale would hide a tiny one
    # |code| <= 1 and finite: a product is NaN only where its scale is NaN or infinite (inf * 0)
    finite = bool(torch.isfinite(scales).all())
    raw_bytes = raw.numpy()
    chunk_blocks = max(1, min(n_blocks, CHUNK_ELEMENTS // blocksize))
    scratch = _scratch(chunk_blocks * blocksize)
    scratch_pairs = scratch.numpy().reshape(-1, 2)
    for first_block in range(0, n_blocks, chunk_blocks):
        last_block = min(first_block + chunk_blocks, n_blocks)
        first_element, end_element = first_block * blocksize, min(last_block * blocksize, n_elements)
        first_byte, end_byte = first_element // 2, (end_element + 1) // 2
        count_bytes = end_byte - first_byte
        # mode="clip": every byte is a valid row, and the default "raise" buffers the output (a copy)
        np.take(pairs, raw_bytes[first_byte:end_byte], axis=0, out=scratch_pairs[:count_bytes], mode="clip")
        values = scratch[: (last_block - first_block) * blocksize]
        if 2 * count_bytes < values.numel():
            values[2 * count_bytes :] = 0.0  # the rest of a partial last block: computed, never written out
        blocks = values.view(last_block - first_block, blocksize)
        scale = scales[first_block:last_block, None]
        target = out[first_element:end_element]
        if tiny and (scale.abs() < no_flush_scale).any():
            target.copy_(_multiply_ftz(blocks, scale).view(-1)[: target.numel()])
        elif target.numel() == values.numel():  # whole blocks: the product rounded to fp32, then to ``dtype``
            torch.mul(blocks, scale, out=target.view(blocks.shape))
        else:
            target.copy_(blocks.mul_(scale).view(-1)[: target.numel()])
    # A NaN scale (or inf * 0) makes NaNs: CUDA's arithmetic and conversions give the canonical one
    return (out if finite else canonical_nans(out)).view(shape)


_scratches = threading.local()


def _scratch(elements: int) -> torch.Tensor:
    """This thread's fp32 scratch of at least ``elements`` (reused: verify's threads each decode slice after slice)."""
    held = getattr(_scratches, "buffer", None)
    if held is None or held.numel() < elements:
        _scratches.buffer = held = None
        _scratches.buffer = held = torch.empty(elements, dtype=torch.float32)
    return held[:elements]


CANONICAL_NAN = {2: 0x7FFF, 4: 0x7FFFFFFF, 8: 0x7FFFFFFFFFFFFFFF}  # by element size: all bits but the sign set
_INTEGER = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def canonical_nans(values: torch.Tensor) -> torch.Tensor:
    """``values`` (a contiguous float tensor) with every NaN made CUDA's canonical NaN, whatever bits the CPU's
    arithmetic or cast gave it; in place, and returned."""
    nan = values.isnan()
    if nan.any():
        values.view(_INTEGER[values.element_size()])[nan] = CANONICAL_NAN[values.element_size()]
    return values
