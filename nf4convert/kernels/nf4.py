"""The fused NF4/FP4 dequantize kernel: nested absmax decode and 4-bit decode in one launch.

This file is the formula and the kernel; ``configs.py`` holds the per-GPU launch knobs and ``launch.py``
the launcher (argument layout, fast repeat launches, the torch.compile op).

It reproduces bitsandbytes' CUDA arithmetic bit for bit (``kDequantizeBlockwise``, which takes three
launches and an fp32 absmax buffer for a double-quantized weight):

    A[k]   = fl32( ftz( code2[absmax_u8[k]] * absmax2[k >> log2(nested_blocksize)] ) + offset )   nested
    A[k]   = absmax_fp32[k]                                                                        flat
    out[e] = round_T( ftz( code[nibble(e)] * A[e // blocksize] ) )
    nibble(2i) = packed[i] >> 4,  nibble(2i + 1) = packed[i] & 15            (high nibble first)

``code`` is the canonical NF4/FP4 table (FP4 nibble 8 is -0.0), ``round_T`` is round-to-nearest-even
to fp16/bf16 (identity for fp32), ``fl32`` one fp32 rounding, and ``ftz`` flushes a subnormal product
to a zero of the same sign: bitsandbytes' kernels multiply with flush-to-zero (measured on an H100:
scales near 1e-38 give signed zeros there), while its ``absmax += offset`` is a torch add, which keeps
subnormals. There is no FMA anywhere: the nested multiply and add are two roundings. Triton contracts
``a * b + c`` into one FMA by default, and torch.compile re-emits the kernel without honouring
``enable_fp_fusion=False``, so on CUDA both multiplies and the add are inline PTX (``mul.rn.ftz.f32``,
``add.rn.f32``), which ptxas never contracts. The Triton interpreter runs no inline asm (and has no
FMA) and truncates fp32 to bf16, so there the kernel flushes with a compare and rounds to bf16 with
integer operations, storing the bits; sm_75 (no ``cvt.rn.bf16.f32``) rounds to bf16 the same way.
"""

from __future__ import annotations

import triton
import triton.language as tl

FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # smallest normal fp32
LIFT = tl.constexpr(16777216.0)  # 2^24


@triton.jit
def _mul_ftz(a, b, PTX: tl.constexpr):
    if PTX:
        return tl.inline_asm_elementwise(
            "mul.rn.ftz.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        # As mul.ftz.f32: subnormal operands read as zeros; a product whose 24-bit rounding with an unbounded
        # exponent is below FLT_MIN is flushed. Lifting one operand by 2^24 (exact) gives that rounding.
        a = tl.where(tl.abs(a) < FLT_MIN, a * 0.0, a)
        b = tl.where(tl.abs(b) < FLT_MIN, b * 0.0, b)
        product = a * b
        return tl.where(tl.abs(a * (b * LIFT)) < FLT_MIN * LIFT, product * 0.0, product)


@triton.jit
def _nested_scale(code2, absmax2, offset, PTX: tl.constexpr):
    if PTX:
        # Two roundings, never an FMA, whatever the compiler's fp-fusion setting.
        return tl.inline_asm_elementwise(
            "{ .reg .f32 prod; mul.rn.ftz.f32 prod, $1, $2; add.rn.f32 $0, prod, $3; }",
            "=r,r,r,r",
            [code2, absmax2, tl.broadcast_to(offset, code2.shape)],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        # Interpreter only: numpy rounds each operation on its own.
        return _mul_ftz(code2, absmax2, PTX) + offset


@triton.jit
def _bf16_bits(values):
    # fp32 -> bf16 round-to-nearest-even with integer operations, as int16 bits.
    bits = values.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40
    bf16 = tl.where(values != values, quiet_nan, rounded)
    return bf16.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def dequantize_4bit_kernel(
    packed_ptr,  # packed 4-bit weight, any storage dtype: read as bytes
    absmax_ptr,  # uint8 (nested) or fp32 (flat), one per quant block
    code2_ptr,  # fp32 [256] nested map; unused when flat
    absmax2_ptr,  # fp32 nested absmax, one per NESTED_BLOCKSIZE quant blocks; unused when flat
    offset_ptr,  # fp32 [1] nested offset; unused when flat
    code_ptr,  # fp32 [16] canonical NF4/FP4 table
    out_ptr,  # fp16 / bf16 / fp32 output, or int16 when BF16_BITS
    n_elements,
    n_bytes,  # (n_elements + 1) // 2, passed so Triton sees its divisibility and vectorizes the masks
    HALF_BLOCK: tl.constexpr,  # packed bytes per quant block (blocksize // 2)
    BLOCKS_PER_PROGRAM: tl.constexpr,  # quant blocks per tile: a tile is whole blocks
    NESTED: tl.constexpr,
    NESTED_SHIFT: tl.constexpr,  # log2(nested blocksize)
    PTX: tl.constexpr,  # inline PTX for the exact multiplies and add (CUDA); False in the interpreter
    BF16_BITS: tl.constexpr,  # round to bf16 with integer ops and store int16 bits
    EVICT: tl.constexpr,  # eviction policy for the streamed bytes and output ("" for none)
    MASKED: tl.constexpr,  # False when every tile is whole: plain 16-byte loads and stores
    PAIR_STORE: tl.constexpr,  # even element count: store each byte's two outputs as one word
    PAIR_TYPE: tl.constexpr,  # that word: uint32 for 16-bit outputs, uint64 for fp32
    LUT_SELECT: tl.constexpr,  # decode nibbles with selects on the table held in registers, not a gather
    PERSISTENT: tl.constexpr,  # a fixed grid of programs, each looping over tiles
    STAGES: tl.constexpr,  # software-pipelining depth of that loop
    STORE_CACHE: tl.constexpr,  # cache modifier of the output stores ("" or ".cs", streaming)
):
    if PERSISTENT:
        n_tiles = (n_bytes + HALF_BLOCK * BLOCKS_PER_PROGRAM - 1) // (HALF_BLOCK * BLOCKS_PER_PROGRAM)
        for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
            _tile(
                tile,
                packed_ptr,
                absmax_ptr,
                code2_ptr,
                absmax2_ptr,
                offset_ptr,
                code_ptr,
                out_ptr,
                n_elements,
                n_bytes,
                HALF_BLOCK,
                BLOCKS_PER_PROGRAM,
                NESTED,
                NESTED_SHIFT,
                PTX,
                BF16_BITS,
                EVICT,
                MASKED,
                PAIR_STORE,
                PAIR_TYPE,
                LUT_SELECT,
                STORE_CACHE,
            )
    else:
        _tile(
            tl.program_id(0),
            packed_ptr,
            absmax_ptr,
            code2_ptr,
            absmax2_ptr,
            offset_ptr,
            code_ptr,
            out_ptr,
            n_elements,
            n_bytes,
            HALF_BLOCK,
            BLOCKS_PER_PROGRAM,
            NESTED,
            NESTED_SHIFT,
            PTX,
            BF16_BITS,
            EVICT,
            MASKED,
            PAIR_STORE,
            PAIR_TYPE,
            LUT_SELECT,
            STORE_CACHE,
        )


@triton.jit
def _tile(
    tile,
    packed_ptr,
    absmax_ptr,
    code2_ptr,
    absmax2_ptr,
    offset_ptr,
    code_ptr,
    out_ptr,
    n_elements,
    n_bytes,
    HALF_BLOCK: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    NESTED: tl.constexpr,
    NESTED_SHIFT: tl.constexpr,
    PTX: tl.constexpr,
    BF16_BITS: tl.constexpr,
    EVICT: tl.constexpr,
    MASKED: tl.constexpr,
    PAIR_STORE: tl.constexpr,
    PAIR_TYPE: tl.constexpr,
    LUT_SELECT: tl.constexpr,
    STORE_CACHE: tl.constexpr,
):
    packed_ptr = packed_ptr.to(tl.pointer_type(tl.uint8))
    block = tile * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    block_ok = block < (n_bytes + HALF_BLOCK - 1) // HALF_BLOCK

    # One scale per quant block (a row of the tile), decoded once and broadcast along the row.
    if NESTED:
        absmax_q = tl.load(absmax_ptr + block, mask=block_ok, other=0)
        code2 = tl.load(code2_ptr + absmax_q.to(tl.int32), mask=block_ok, other=0.0, eviction_policy="evict_last")
        absmax2 = tl.load(absmax2_ptr + (block >> NESTED_SHIFT), mask=block_ok, other=0.0, eviction_policy="evict_last")
        scale = _nested_scale(code2, absmax2, tl.load(offset_ptr), PTX)
    else:
        scale = tl.load(absmax_ptr + block, mask=block_ok, other=0.0).to(tl.float32)
    scale = scale[:, None]

    byte = block[:, None] * HALF_BLOCK + tl.arange(0, HALF_BLOCK)[None, :]
    packed = tl.load(
        packed_ptr + byte, mask=(byte < n_bytes) if MASKED else None, other=0 if MASKED else None, eviction_policy=EVICT
    )
    high = _mul_ftz(_lut(code_ptr, (packed >> 4).to(tl.int32), LUT_SELECT), scale, PTX)
    low = _mul_ftz(_lut(code_ptr, (packed & 15).to(tl.int32), LUT_SELECT), scale, PTX)
    if PAIR_STORE:
        # Element 2i (the high nibble) and 2i + 1 share one 2x-wide word, low half first (little
        # endian): one store per byte, no interleave and so no trip through shared memory.
        tl.store(
            out_ptr.to(tl.pointer_type(PAIR_TYPE)) + byte,
            _pair(high, low, out_ptr, BF16_BITS, PAIR_TYPE),
            mask=(byte < n_bytes) if MASKED else None,
            eviction_policy=EVICT,
            cache_modifier=STORE_CACHE,
        )
    else:
        values = tl.interleave(high, low)  # element 2i is the high nibble of byte i
        if BF16_BITS:
            values = _bf16_bits(values)
        else:
            values = values.to(out_ptr.dtype.element_ty)
        element = block[:, None] * (2 * HALF_BLOCK) + tl.arange(0, 2 * HALF_BLOCK)[None, :]
        tl.store(
            out_ptr + element,
            values,
            mask=(element < n_elements) if MASKED else None,
            eviction_policy=EVICT,
            cache_modifier=STORE_CACHE,
        )


@triton.jit
def _lut(code_ptr, nibble, LUT_SELECT: tl.constexpr):
    if LUT_SELECT:
        # The 16 entries as scalars (uniform loads, issued before the packed bytes arrive), then a
        # select tree on the nibble's bits: no load waits on the packed bytes.
        bit0 = (nibble & 1) != 0
        bit1 = (nibble & 2) != 0
        bit2 = (nibble & 4) != 0
        pair0 = tl.where(bit0, tl.load(code_ptr + 1), tl.load(code_ptr + 0))
        pair1 = tl.where(bit0, tl.load(code_ptr + 3), tl.load(code_ptr + 2))
        pair2 = tl.where(bit0, tl.load(code_ptr + 5), tl.load(code_ptr + 4))
        pair3 = tl.where(bit0, tl.load(code_ptr + 7), tl.load(code_ptr + 6))
        pair4 = tl.where(bit0, tl.load(code_ptr + 9), tl.load(code_ptr + 8))
        pair5 = tl.where(bit0, tl.load(code_ptr + 11), tl.load(code_ptr + 10))
        pair6 = tl.where(bit0, tl.load(code_ptr + 13), tl.load(code_ptr + 12))
        pair7 = tl.where(bit0, tl.load(code_ptr + 15), tl.load(code_ptr + 14))
        quad0 = tl.where(bit1, pair1, pair0)
        quad1 = tl.where(bit1, pair3, pair2)
        quad2 = tl.where(bit1, pair5, pair4)
        quad3 = tl.where(bit1, pair7, pair6)
        return tl.where((nibble & 8) != 0, tl.where(bit2, quad3, quad2), tl.where(bit2, quad1, quad0))
    else:
        # The 64-byte table stays in L1; a gather from it is one load per element.
        return tl.load(code_ptr + nibble, eviction_policy="evict_last")


@triton.jit
def _pair(high, low, out_ptr, BF16_BITS: tl.constexpr, PAIR_TYPE: tl.constexpr):
    if BF16_BITS:
        high_bits = _bf16_bits(high).to(tl.uint16, bitcast=True).to(tl.uint32)
        low_bits = _bf16_bits(low).to(tl.uint16, bitcast=True).to(tl.uint32)
        return high_bits | (low_bits << 16)
    elif PAIR_TYPE == tl.uint64:
        return high.to(tl.uint32, bitcast=True).to(tl.uint64) | (low.to(tl.uint32, bitcast=True).to(tl.uint64) << 32)
    else:
        out_type = out_ptr.dtype.element_ty
        high_bits = high.to(out_type).to(tl.uint16, bitcast=True).to(tl.uint32)
        low_bits = low.to(out_type).to(tl.uint16, bitcast=True).to(tl.uint32)
        return high_bits | (low_bits << 16)
