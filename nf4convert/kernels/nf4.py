"""The fused NF4/FP4 dequantize kernel: nested absmax decode and 4-bit decode in one launch.

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

import contextlib
import os
from dataclasses import dataclass
from typing import List, Optional

import torch
import triton
import triton.language as tl

# triton.jit reads this once, when the kernel below is defined; so do we.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


FLT_MIN = tl.constexpr(1.1754943508222875e-38)  # smallest normal fp32


@triton.jit
def _mul_ftz(a, b, PTX: tl.constexpr):
    if PTX:
        return tl.inline_asm_elementwise(
            "mul.rn.ftz.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        product = a * b
        return tl.where(tl.abs(product) < FLT_MIN, product * 0.0, product)


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
            _tile(tile, packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, code_ptr, out_ptr, n_elements, n_bytes,
                  HALF_BLOCK, BLOCKS_PER_PROGRAM, NESTED, NESTED_SHIFT, PTX, BF16_BITS, EVICT, MASKED, PAIR_STORE, PAIR_TYPE, LUT_SELECT, STORE_CACHE)  # fmt: skip
    else:
        _tile(tl.program_id(0), packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, code_ptr, out_ptr, n_elements, n_bytes,
              HALF_BLOCK, BLOCKS_PER_PROGRAM, NESTED, NESTED_SHIFT, PTX, BF16_BITS, EVICT, MASKED, PAIR_STORE, PAIR_TYPE, LUT_SELECT, STORE_CACHE)  # fmt: skip


@triton.jit
def _tile(tile, packed_ptr, absmax_ptr, code2_ptr, absmax2_ptr, offset_ptr, code_ptr, out_ptr, n_elements, n_bytes,
          HALF_BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr, NESTED: tl.constexpr, NESTED_SHIFT: tl.constexpr,
          PTX: tl.constexpr, BF16_BITS: tl.constexpr, EVICT: tl.constexpr, MASKED: tl.constexpr, PAIR_STORE: tl.constexpr,
          PAIR_TYPE: tl.constexpr, LUT_SELECT: tl.constexpr, STORE_CACHE: tl.constexpr):  # fmt: skip
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
    packed = tl.load(packed_ptr + byte, mask=(byte < n_bytes) if MASKED else None, other=0 if MASKED else None,
                     eviction_policy=EVICT)  # fmt: skip
    high = _mul_ftz(_lut(code_ptr, (packed >> 4).to(tl.int32), LUT_SELECT), scale, PTX)
    low = _mul_ftz(_lut(code_ptr, (packed & 15).to(tl.int32), LUT_SELECT), scale, PTX)
    if PAIR_STORE:
        # Element 2i (the high nibble) and 2i + 1 share one 2x-wide word, low half first (little
        # endian): one store per byte, no interleave and so no trip through shared memory.
        tl.store(out_ptr.to(tl.pointer_type(PAIR_TYPE)) + byte, _pair(high, low, out_ptr, BF16_BITS, PAIR_TYPE),
                 mask=(byte < n_bytes) if MASKED else None, eviction_policy=EVICT, cache_modifier=STORE_CACHE)  # fmt: skip
    else:
        values = tl.interleave(high, low)  # element 2i is the high nibble of byte i
        if BF16_BITS:
            values = _bf16_bits(values)
        else:
            values = values.to(out_ptr.dtype.element_ty)
        element = block[:, None] * (2 * HALF_BLOCK) + tl.arange(0, 2 * HALF_BLOCK)[None, :]
        tl.store(out_ptr + element, values, mask=(element < n_elements) if MASKED else None, eviction_policy=EVICT,
                 cache_modifier=STORE_CACHE)  # fmt: skip


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


# Launch knobs by compute capability (prefix match; () is the default). Speed only: every config is
# bit-exact. Rows: (largest packed size in bytes, Config).
@dataclass(frozen=True)
class Config:
    tile_bytes: int  # packed bytes per tile (whole quant blocks)
    num_warps: int
    evict: bool  # evict_first hints on the streamed bytes and output
    lut_select: bool = False  # nibble decode by selects instead of an L1 gather
    programs_per_sm: int = 0  # > 0: persistent grid of this many programs per SM
    stages: int = 1  # pipelining depth of the persistent loop
    streaming_stores: bool = False  # st.global.cs for the output
    ptx: bool = True  # inline PTX for the exact multiplies; False: plain ops and a compare-flush (exact
    # only with fp fusion off, so never under torch.compile: the benchmark's "no PTX" column)


CONFIGS = {
    # Measured on an H100 (benchmarks/bench_dequant.py, README): evict_first hints help small
    # weights and cost ~1% on large ones; 8 warps per 2 KiB tile edge ahead past 16 MiB packed.
    (): (
        (1 << 16, Config(512, 2, False)),
        (1 << 21, Config(1024, 4, True)),
        (1 << 24, Config(2048, 4, False)),
        (None, Config(2048, 8, False)),
    ),
    # T4: only L1 eviction hints exist there; keep the plain loads.
    (7, 5): ((None, Config(1024, 4, False)),),
}
# Set by the benchmark to a Config to measure a variant.
CONFIG_OVERRIDE: Optional[Config] = None

_devices: dict = {}


def _device_info(device: torch.device) -> tuple:
    """(compute capability, multiprocessor count) of a CUDA device, read once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    info = _devices.get(index)
    if info is None:
        info = _devices[index] = (torch.cuda.get_device_capability(index), torch.cuda.get_device_properties(index).multi_processor_count)
    return info


def choose_config(n_bytes: int, capability: tuple) -> Config:
    """The launch config for a weight of ``n_bytes`` packed bytes on a GPU of ``capability``."""
    if CONFIG_OVERRIDE is not None:
        return CONFIG_OVERRIDE
    table = CONFIGS.get(tuple(capability)) or CONFIGS.get(tuple(capability[:1])) or CONFIGS[()]
    for limit, config in table:
        if limit is None or n_bytes <= limit:
            return config
    return table[-1][1]


def launch_config(n_elements, blocksize, nested_blocksize, nested, out_dtype, capability, sm_count=132):
    """(grid, constexprs, num_warps) for one weight; ``capability`` None means the interpreter."""
    half_block = blocksize // 2
    n_bytes = (n_elements + 1) // 2
    if capability is None and CONFIG_OVERRIDE is None:
        config = Config(max(half_block, 4096), 4, False)  # the interpreter: few, large programs
    else:
        config = choose_config(n_bytes, capability)
    blocks = max(1, config.tile_bytes // half_block)
    n_tiles = -(-n_bytes // (half_block * blocks))
    persistent = config.programs_per_sm > 0 and n_tiles > sm_count * config.programs_per_sm
    constexprs = dict(
        HALF_BLOCK=half_block,
        BLOCKS_PER_PROGRAM=blocks,
        NESTED=nested,
        NESTED_SHIFT=nested_blocksize.bit_length() - 1 if nested else 0,
        PTX=capability is not None and config.ptx,
        BF16_BITS=out_dtype == torch.bfloat16 and (capability is None or tuple(capability) < (8, 0)),
        EVICT="evict_first" if config.evict else "",
        MASKED=n_elements % (2 * half_block * blocks) != 0,
        PAIR_STORE=n_elements % 2 == 0,
        PAIR_TYPE=tl.uint64 if out_dtype == torch.float32 else tl.uint32,
        LUT_SELECT=config.lut_select,
        PERSISTENT=persistent,
        STAGES=config.stages,
        STORE_CACHE=".cs" if config.streaming_stores else "",
    )
    grid = (sm_count * config.programs_per_sm,) if persistent else (n_tiles,)
    return grid, constexprs, config.num_warps


def _plan(packed, absmax, code2, absmax2, offset, code, out, blocksize, nested_blocksize):
    """Everything a launch needs: (grid, args, constexprs, num_warps)."""
    nested = code2 is not None
    capability, sm_count = (None, 1) if INTERPRET or out.device.type != "cuda" else _device_info(out.device)
    grid, constexprs, num_warps = launch_config(
        out.numel(), blocksize, nested_blocksize, nested, out.dtype, capability, sm_count
    )
    args = (
        packed,
        absmax,
        code2 if nested else absmax,
        absmax2 if nested else absmax,
        offset if nested else absmax,
        code,
        out.view(torch.int16) if constexprs["BF16_BITS"] else out,
        out.numel(),
        (out.numel() + 1) // 2,
    )
    return grid, args, constexprs, num_warps


# --- eager launches ------------------------------------------------------------------------------
# JITFunction.__call__ binds and re-specializes every argument in Python on every call, which costs
# more than the kernel on small weights. After the first launch of a specialization we keep Triton's
# CompiledKernel and call its launcher directly. The key holds everything Triton specializes on.

_compiled: dict = {}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_fast_launch = _raw_stream is not None and not INTERPRET and os.environ.get("NF4CONVERT_FAST_LAUNCH", "1") != "0"


_runtime_knobs = getattr(getattr(triton, "knobs", None), "runtime", None)


def _hooks_active() -> bool:
    """Whether a profiler hooks Triton's launches: then launches take Triton's own path."""
    if _runtime_knobs is None:
        return True  # older Triton keeps hooks elsewhere: take its own path
    enter, exit_ = _runtime_knobs.launch_enter_hook, _runtime_knobs.launch_exit_hook
    # Triton 3.5+ always installs a HookChain, which is empty unless something registered a hook.
    return (enter is not None and getattr(enter, "calls", True) != []) or (exit_ is not None and getattr(exit_, "calls", True) != [])


def _specialization(args, constexprs, num_warps, device_index):
    tensors = tuple((a.dtype, a.data_ptr() % 16 == 0) for a in args[:7])
    integers = tuple((n == 1, n % 16 == 0, n >= 2**31) for n in args[7:])
    return device_index, tensors, integers, tuple(constexprs.values()), num_warps


def launch(packed, absmax, code2, absmax2, offset, code, out, blocksize, nested_blocksize):
    """Dequantize into ``out`` (contiguous, on the inputs' device); inputs are trusted here.

    Returns a function ``replay(out)`` that repeats this launch into another output of the same
    dtype and size (fresh from torch's caching allocator, so 16-byte aligned) with no per-call
    Python beyond Triton's C launcher, or None where that is not available.
    """
    global _fast_launch
    grid, args, constexprs, num_warps = _plan(
        packed, absmax, code2, absmax2, offset, code, out, blocksize, nested_blocksize
    )
    if INTERPRET or out.device.type != "cuda":
        dequantize_4bit_kernel[grid](*args, **constexprs, num_warps=num_warps)
        return None
    device_index = out.device.index
    guard = contextlib.nullcontext() if device_index == torch.cuda.current_device() else torch.cuda.device(device_index)
    with guard:
        if not _fast_launch or _hooks_active():
            dequantize_4bit_kernel[grid](*args, **constexprs, num_warps=num_warps, enable_fp_fusion=False)
            return None
        key = _specialization(args, constexprs, num_warps, device_index)
        compiled = _compiled.get(key)
        if compiled is None:
            compiled = dequantize_4bit_kernel[grid](*args, **constexprs, num_warps=num_warps, enable_fp_fusion=False)
            if not (hasattr(compiled, "packed_metadata") and hasattr(compiled, "run")):
                _fast_launch = False  # a Triton without these: its own launch path from now on
                return None
            _compiled[key] = compiled
        else:
            try:
                compiled.run(grid[0], 1, 1, _raw_stream(device_index), compiled.function,
                             compiled.packed_metadata, None, None, None, *args, *constexprs.values())  # fmt: skip
            except Exception:  # a Triton whose launcher takes other arguments: its own path from now on
                _fast_launch = False
                _compiled.clear()
                dequantize_4bit_kernel[grid](*args, **constexprs, num_warps=num_warps, enable_fp_fusion=False)
                return None
    return _replayer(compiled, grid[0], device_index, args, tuple(constexprs.values()))


def _replayer(compiled, n_programs, device_index, args, constexpr_values):
    # Pointers as integers: the caller checks that the tensors behind them are still the ones given.
    before = tuple(a.data_ptr() for a in args[:6])
    after = (*args[7:], *constexpr_values)
    run, function, metadata, stream = compiled.run, compiled.function, compiled.packed_metadata, _raw_stream

    def replay(out):
        if device_index != torch.cuda.current_device() or _hooks_active():
            return False
        run(n_programs, 1, 1, stream(device_index), function, metadata, None, None, None, *before, out.data_ptr(), *after)
        return True

    return replay


# --- torch.compile ---------------------------------------------------------------------------------
# A triton_op lets Inductor see the kernel and schedule it inside the graph; offset and the tables
# travel as tensors, so one compiled graph serves every layer of a model.


@torch.library.triton_op("nf4convert::dequantize_4bit", mutates_args=())
def dequantize_4bit_op(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    code2: Optional[torch.Tensor],
    absmax2: Optional[torch.Tensor],
    offset: Optional[torch.Tensor],
    code: torch.Tensor,
    blocksize: int,
    nested_blocksize: int,
    shape: List[int],
    dtype: torch.dtype,
) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    grid, args, constexprs, num_warps = _plan(
        packed, absmax, code2, absmax2, offset, code, out, blocksize, nested_blocksize
    )
    torch.library.wrap_triton(dequantize_4bit_kernel)[grid](*args, **constexprs, num_warps=num_warps)
    return out
