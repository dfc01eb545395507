"""Shared test helpers: fresh random quantized weights and bit-level comparison."""

import random

import torch

STORAGE_DTYPES = (torch.uint8, torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, flattened, for bit-for-bit comparison (signed zeros too)."""
    integer = {2: torch.int16, 4: torch.int32}[tensor.element_size()]
    return tensor.contiguous().view(-1).view(integer)


def random_weight(shape, dtype, *, generator=None, device="cpu"):
    """Normal weights with outliers (a few columns scaled by up to 1000) and some exact zeros."""
    weight = torch.randn(shape, generator=generator, dtype=torch.float32) * 0.02
    flat = weight.view(-1)
    n = flat.numel()
    count = max(1, n // 50)
    idx = torch.randint(0, n, (count,), generator=generator)
    flat[idx] *= torch.empty(count).uniform_(10, 1000, generator=generator)
    flat[torch.randint(0, n, (max(1, n // 97),), generator=generator)] = 0.0
    return weight.to(dtype).to(device)


def quantize(shape, *, quant_type, blocksize, nested, dtype, storage=torch.uint8, device="cpu", seed=None, scale=None):
    import bitsandbytes.functional as F

    generator = torch.Generator().manual_seed(seed if seed is not None else random.randrange(1 << 30))
    weight = random_weight(shape, dtype, generator=generator, device=device)
    if scale is not None:
        weight = weight * scale
    packed, state = F.quantize_4bit(
        weight, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested, quant_storage=storage
    )
    return packed, state


def nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    flat = packed.contiguous().view(torch.uint8).view(-1).to(torch.int32)
    return torch.stack((flat >> 4, flat & 15), dim=1).view(-1)[:n]


def bnb_reference_cpu(packed, state):
    """What bitsandbytes' CUDA kernels give, computed on the CPU: nf4convert.verification.reference.cuda_arithmetic.dequantize_4bit.

    bitsandbytes' native CPU op is not the reference (per-row absmax on AVX512 machines, +0.0 for FP4
    nibble 8, no flush-to-zero in its nested decode); the reference module says why each step is as it is,
    and tests/test_reference.py checks it against the native op where that is right and against the CUDA
    kernels on a GPU.
    """
    from nf4convert.verification.reference.cuda_arithmetic import dequantize_4bit

    return dequantize_4bit(packed, state, dtype=state.dtype, device="cpu")
