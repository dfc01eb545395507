"""The dequantize kernel as a torch.compile op (imported only when a trace reaches it: registering a triton_op
imports torch's compiler, seconds that eager launches and the converter need not pay).

A triton_op lets Inductor see the kernel and launch it inside the graph; offset and the tables travel as tensors,
so one compiled graph serves every layer of a model. The compiled kernel's GPU time equals eager's; per weight, a
compiled forward pays Inductor's launch path, which costs more host time than the eager launcher's replay unless
Inductor's ``static_launch_user_defined_triton_kernels`` hands the launch to torch's C++ launcher (docs/performance.md).
Two other forms were measured and were slower: an opaque ``torch.library.custom_op`` calling the eager launcher, and
an op defined with ``torch.library.define`` whose CUDA kernel replays the eager launch.

CPU tensors take their own op, an opaque ``torch.library.custom_op`` around the exact CPU path (``cpu.py``), with a
fake implementation that gives Dynamo the output's shape and dtype. Opaque on purpose: traced, its fp32 multiplies and
adds would be Inductor's to fuse, and Inductor's C++ kernels contract ``a * b + c`` into FMAs (one rounding where
bitsandbytes' CUDA kernels make two); the CPU path also decodes with a numpy gather that Dynamo cannot trace.
"""

from __future__ import annotations

from typing import List, Optional

import torch

try:
    from .launch import _plan
    from .nf4 import dequantize_4bit_kernel
except ImportError as error:  # without Triton only the CPU op is registered; the CPU path never needs Triton
    if (error.name or "").split(".")[0] != "triton":
        raise
    HAS_TRITON = False
else:
    HAS_TRITON = True


def _dequantize_cuda(
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


# The one argument list, read from _dequantize_cuda's annotations (triton_op infers it from them, and takes no other).
SCHEMA = torch.library.infer_schema(_dequantize_cuda, mutates_args=())
if HAS_TRITON:
    dequantize_4bit_op = torch.library.triton_op("nf4convert::dequantize_4bit", _dequantize_cuda, mutates_args=())


@torch.library.custom_op("nf4convert::dequantize_4bit_cpu", mutates_args=(), device_types="cpu", schema=SCHEMA)
def dequantize_4bit_cpu_op(packed, absmax, code2, absmax2, offset, code, blocksize, nested_blocksize, shape, dtype):
    from .cpu import dequantize_tensors

    out = torch.empty(shape, dtype=dtype, device=packed.device)
    dequantize_tensors(packed.contiguous(), absmax, code2, absmax2, offset, code, out, blocksize, nested_blocksize)
    return out


@dequantize_4bit_cpu_op.register_fake
def _(packed, absmax, code2, absmax2, offset, code, blocksize, nested_blocksize, shape, dtype):
    return packed.new_empty(shape, dtype=dtype)
