"""The eager launcher of the dequantize kernel: argument layout and fast repeat launches (the torch.compile op is
in ``compiled.py``: registering it imports torch's compiler, seconds that an eager launch need not pay).

Inputs here are trusted (``nf4convert.dequantize`` checked them).
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton

from ..settings import Settings
from . import configs
from .nf4 import dequantize_4bit_kernel

# triton.jit reads this once, when the kernel is defined; so do we.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_devices: dict = {}


def _device_info(device: torch.device) -> tuple:
    """(compute capability, multiprocessor count, name) of a CUDA device, read once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    info = _devices.get(index)
    if info is None:
        properties = torch.cuda.get_device_properties(index)
        capability = torch.cuda.get_device_capability(index)
        info = _devices[index] = (capability, properties.multi_processor_count, properties.name)
    return info


def _plan(packed, absmax, code2, absmax2, offset, code, out, blocksize, nested_blocksize):
    """Everything a launch needs: (grid, args, constexprs, num_warps)."""
    nested = code2 is not None
    on_gpu = not INTERPRET and out.device.type == "cuda"
    capability, sm_count, gpu_name = _device_info(out.device) if on_gpu else (None, 1, "")
    grid, constexprs, num_warps = configs.launch_config(
        out.numel(), blocksize, nested_blocksize, nested, out.dtype, capability, sm_count, gpu_name
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
_fast_launch = None  # decided at the first eager launch (NF4CONVERT_FAST_LAUNCH read then, not at import: a compiled
# model imports this module for _plan and never launches through here)


_runtime_knobs = getattr(getattr(triton, "knobs", None), "runtime", None)


def _hooks_active() -> bool:
    """Whether a profiler hooks Triton's launches: then launches take Triton's own path."""
    if _runtime_knobs is None:
        return True  # older Triton keeps hooks elsewhere: take its own path
    enter, exit_ = _runtime_knobs.launch_enter_hook, _runtime_knobs.launch_exit_hook
    # Triton 3.5+ always installs a HookChain, which is empty unless something registered a hook.
    return (enter is not None and getattr(enter, "calls", True) != []) or (
        exit_ is not None and getattr(exit_, "calls", True) != []
    )


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
        if _fast_launch is None:
            _fast_launch = _raw_stream is not None and Settings.from_env().fast_launch
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
                compiled.run(
                    grid[0],
                    1,
                    1,
                    _raw_stream(device_index),
                    compiled.function,
                    compiled.packed_metadata,
                    None,
                    None,
                    None,
                    *args,
                    *constexprs.values(),
                )
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
        run(
            n_programs,
            1,
            1,
            stream(device_index),
            function,
            metadata,
            None,
            None,
            None,
            *before,
            out.data_ptr(),
            *after,
        )
        return True

    return replay
