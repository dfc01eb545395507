"""Compile the kernel ahead of time for a GPU target with no GPU present; print what the PTX holds.

Run as a script (the test runs it in a subprocess, since the interpreter replaces triton.jit):
    python tests/aot_build.py 75 [fp_fusion]
"""

import json
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nf4convert.kernels import configs, nf4

SIGNATURE_TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}


def compile_for(capability, out_dtype, nested, n_elements=1 << 24, blocksize=64, fp_fusion=False, sm_count=40):
    """Triton's CompiledKernel for ``capability`` as the launcher would configure it, with its grid."""
    grid, constexprs, num_warps = configs.launch_config(
        n_elements, blocksize, 256, nested, out_dtype, capability, sm_count
    )
    out_type = "*i16" if constexprs["BF16_BITS"] else SIGNATURE_TYPES[out_dtype]
    signature = {
        "packed_ptr": "*u8",
        "absmax_ptr": "*u8" if nested else "*fp32",
        "code2_ptr": "*fp32",
        "absmax2_ptr": "*fp32",
        "offset_ptr": "*fp32",
        "code_ptr": "*fp32",
        "out_ptr": out_type,
        "n_elements": "i32",
        "n_bytes": "i32",
        **{name: "constexpr" for name in constexprs},
    }
    source = ASTSource(fn=nf4.dequantize_4bit_kernel, signature=signature, constexprs=constexprs)
    target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
    compiled = triton.compile(source, target=target, options={"num_warps": num_warps, "enable_fp_fusion": fp_fusion})
    return compiled, grid, constexprs


def build(capability, out_dtype, nested, fp_fusion):
    compiled, _, constexprs = compile_for(capability, out_dtype, nested, fp_fusion=fp_fusion)
    ptx = compiled.asm["ptx"]
    return {
        "dtype": str(out_dtype),
        "nested": nested,
        "bf16_bits": constexprs["BF16_BITS"],
        "target": next(line.split()[1] for line in ptx.splitlines() if line.startswith(".target")),
        "cubin_bytes": len(compiled.asm["cubin"]),
        "mul_rn": ptx.count("mul.rn.ftz.f32"),
        "add_rn": ptx.count("add.rn.f32"),
        "fma": ptx.count("fma.rn.f32"),
        "cvt_bf16": ptx.count("cvt.rn.bf16"),
    }


if __name__ == "__main__":
    capability = divmod(int(sys.argv[1]), 10)
    fp_fusion = len(sys.argv) > 2 and sys.argv[2] == "fp_fusion"
    results = [
        build(capability, dtype, nested, fp_fusion)
        for dtype in (torch.float16, torch.bfloat16, torch.float32)
        for nested in (True, False)
    ]
    print(json.dumps(results))
