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


def quantize(shape, *, quant_type, blocksize, nested, dtype, storage=torch.uint8, device="cpu", seed=None):
    import bitsandbytes.functional as F

    generator = torch.Generator().manual_seed(seed if seed is not None else random.randrange(1 << 30))
    weight = random_weight(shape, dtype, generator=generator, device=device)
    packed, state = F.quantize_4bit(
        weight, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested, quant_storage=storage
    )
    return packed, state


def nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    flat = packed.contiguous().view(torch.uint8).view(-1).to(torch.int32)
    return torch.stack((flat >> 4, flat & 15), dim=1).view(-1)[:n]


def bnb_reference_cpu(packed, state):
    """What bitsandbytes' CUDA kernel gives, computed on the CPU by bitsandbytes' own code.

    bitsandbytes' native CPU op is not the reference: on AVX512 machines it indexes absmax per row
    (wrong when the last dimension is not a multiple of blocksize) and decodes FP4 nibble 8 as +0.0,
    where the CUDA kernel (the truth) gives -0.0. Its pure-torch reference, _dequantize_4bit_compute
    (flat blocks, one fp32 multiply, then a cast), fed the CUDA kernel's table, is. The nested absmax
    is bitsandbytes' own dequantize_blockwise plus the offset, exactly as its dequantize_4bit does.
    """
    import bitsandbytes.functional as F
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    if state.nested:
        absmax = F.dequantize_blockwise(state.absmax, state.state2)
        absmax += state.offset
    else:
        absmax = state.absmax.float()
    code = F.get_4bit_type(state.quant_type, device="cpu").clone()
    if state.quant_type == "fp4":
        code[8] = -0.0  # CUDA: sign * 0.0f
    flat = packed.contiguous().view(torch.uint8).reshape(-1)
    return _dequantize_4bit_compute(flat, absmax, code, state.blocksize, state.shape, state.dtype)
