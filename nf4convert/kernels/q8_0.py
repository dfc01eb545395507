"""GGUF's Q8_0 blocks and BF16 words computed with torch (on a GPU, or on every CPU core), bit-equal to gguf-py's numpy
quantizer (``gguf.quants.Q8_0`` and ``BF16``), which is itself bit-equal to ggml's reference.

A Q8_0 block is 32 values: ``d = max|x| / 127`` stored as fp16, then 32 int8 ``round(x / d)``, rounded half away from
zero. gguf-py computes it in fp32 with single IEEE operations (a division, a reciprocal, a product, floors), which
torch computes to the same bits on any device: no fused or reassociated arithmetic is involved. A block whose result is
not finite along the way (a NaN or ±inf among its values, or a scale so small that its reciprocal overflows) goes to
``edge_blocks``, gguf-py's own quantizer: what such a block becomes depends on how numpy converts NaN to int8 and
fp16 on the machine at hand, which torch need not share.
"""

from __future__ import annotations

from typing import Callable

BLOCK = 32  # values per Q8_0 block
BLOCK_BYTES = 2 + BLOCK  # the fp16 scale, then the int8 values
CHUNK_VALUES = 1 << 22  # values quantized per step: fp32 temporaries of a few of these stay small


def q8_0_bytes(values) -> int:
    """The Q8_0 size of ``values`` (its element count a multiple of 32)."""
    return values.numel() // BLOCK * BLOCK_BYTES


def quantize_q8_0(values, edge_blocks: Callable):
    """``values`` (a float tensor of any dtype on any device, its element count a multiple of 32, read in row-major
    order) as Q8_0 blocks: a uint8 tensor of ``numel / 32 * 34`` bytes on the same device. ``edge_blocks(blocks)``
    quantizes the blocks torch leaves alone (a float32 numpy array of shape (n, 32) -> uint8 (n, 34)): gguf-py's own
    ``Q8_0.quantize_blocks``."""
    import torch

    blocks = values.reshape(-1, BLOCK).float()  # exact from fp16 and bf16
    magnitude = blocks.abs().amax(dim=1, keepdim=True)
    scale = magnitude / 127
    inverse = torch.where(scale == 0, torch.zeros_like(scale), torch.reciprocal(scale))
    scaled = blocks * inverse
    # np_roundf: round half away from zero, as floor(|x|) + floor(2 * (|x| - floor(|x|))), each step exact
    absolute = scaled.abs()
    floored = absolute.floor()
    rounded = torch.sign(scaled) * (floored + (2 * (absolute - floored)).floor())
    finite = torch.isfinite(rounded).all(dim=1)
    out = torch.empty((blocks.shape[0], BLOCK_BYTES), dtype=torch.uint8, device=blocks.device)
    out[:, :2] = scale.to(torch.float16).view(torch.uint8)
    out[:, 2:] = torch.where(torch.isfinite(rounded), rounded, 0).to(torch.int8).view(torch.uint8)
    if not bool(finite.all()):
        edge = (~finite).nonzero().flatten()
        made = edge_blocks(blocks[edge].cpu().numpy())
        out[edge] = torch.from_numpy(made).to(out.device)
    return out.view(-1)


def quiet_bf16(words):
    """bf16 values (an int16 view, any device) as gguf-py's BF16 conversion writes them back: the same, but every NaN
    with its quiet bit set (gguf-py rounds from fp32, which for a value that was bf16 changes nothing else)."""
    import torch

    nan = torch.bitwise_and(words, 0x7FFF) > 0x7F80
    if not bool(nan.any()):
        return words
    return torch.where(nan, torch.bitwise_or(words, 0x0040), words)
