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
CHUNK_VALUES = 1 << 20  # values quantized per step on a CPU, in buffers reused from step to step (cache-sized)
CUDA_CHUNK_VALUES = 1 << 24  # on a GPU: fewer launches and copies back, for buffers of a few hundred MB


class Q8_0:
    """Quantizes to Q8_0 on one device, chunk by chunk, in buffers it keeps: on a CPU, a fresh tensor for each step
    of each chunk would cost more in page faults than the arithmetic. ``edge_blocks(blocks)`` quantizes the blocks
    torch leaves alone (a float32 numpy array of shape (n, 32) -> uint8 (n, 34)): gguf-py's own
    ``Q8_0.quantize_blocks``."""

    def __init__(self, device, edge_blocks: Callable):
        import torch

        self.device = torch.device(device)
        self.chunk_values = CUDA_CHUNK_VALUES if self.device.type == "cuda" else CHUNK_VALUES
        blocks = self.chunk_values // BLOCK
        self.edge_blocks = edge_blocks
        self._values = torch.empty((blocks, BLOCK), dtype=torch.float32, device=device)
        self._work = torch.empty((blocks, BLOCK), dtype=torch.float32, device=device)
        self._floored = torch.empty((blocks, BLOCK), dtype=torch.float32, device=device)
        self._scale = torch.empty((blocks, 1), dtype=torch.float32, device=device)
        self._inverse = torch.empty((blocks, 1), dtype=torch.float32, device=device)
        self._out = torch.empty((blocks, BLOCK_BYTES), dtype=torch.uint8, device=device)
        # a tensor, not the number: CUDA divides by a host scalar as a product with its reciprocal, rounded twice
        self._127 = torch.full((1, 1), 127.0, dtype=torch.float32, device=device)

    def __call__(self, values):
        """``values`` (a float tensor of any dtype on this device, at most ``chunk_values`` of them, a multiple of 32,
        read in row-major order) as Q8_0 blocks: a uint8 tensor of ``numel / 32 * 34`` bytes on this device, valid
        until the next call."""
        import torch

        n = values.numel() // BLOCK
        blocks, work, floored = self._values[:n], self._work[:n], self._floored[:n]
        scale, inverse, out = self._scale[:n], self._inverse[:n], self._out[:n]
        blocks.copy_(values.reshape(n, BLOCK))  # to fp32: exact from fp16 and bf16
        torch.abs(blocks, out=work)
        torch.amax(work, dim=1, keepdim=True, out=scale)
        torch.div(scale, self._127, out=scale)
        torch.reciprocal(scale, out=inverse)
        inverse.masked_fill_(scale == 0, 0)
        torch.mul(blocks, inverse, out=work)  # the scaled values
        # np_roundf: round half away from zero, as sign(x) * (floor(|x|) + floor(2 * (|x| - floor(|x|)))), each step
        # exact
        torch.abs(work, out=blocks)
        torch.floor(blocks, out=floored)
        blocks.sub_(floored).mul_(2).floor_().add_(floored)
        torch.sign(work, out=work)
        work.mul_(blocks)
        out[:, :2].copy_(scale.to(torch.float16).view(torch.uint8))
        out[:, 2:].copy_(work.to(torch.int8).view(torch.uint8))
        # A block's rounded values are all finite exactly when its scale and that scale's inverse are: a NaN or ±inf
        # among its values makes the scale so (amax propagates NaN), and with both finite |x / d| stays near 127.
        finite = torch.isfinite(scale) & torch.isfinite(inverse)
        if not bool(finite.all()):
            edge = (~finite).nonzero()[:, 0]
            original = values.reshape(n, BLOCK)[edge].float().cpu().numpy()
            out[edge] = torch.from_numpy(self.edge_blocks(original)).to(out.device)
        return out.view(-1)


def quantize_q8_0(values, edge_blocks: Callable):
    """``values`` (a float tensor of any dtype on any device, its element count a multiple of 32, read in row-major
    order) as Q8_0 blocks: a new uint8 tensor of ``numel / 32 * 34`` bytes on the same device (``Q8_0``, chunk by
    chunk)."""
    import torch

    quantize = Q8_0(values.device, edge_blocks)
    flat, step = values.reshape(-1), quantize.chunk_values
    return torch.cat([quantize(flat[first : first + step]).clone() for first in range(0, flat.numel(), step)])


def quiet_bf16(words):
    """bf16 values (an int16 view, any device) as gguf-py's BF16 conversion writes them back: the same, but every NaN
    with its quiet bit set (gguf-py rounds from fp32, which for a value that was bf16 changes nothing else)."""
    import torch

    if words.device.type == "cpu":  # numpy's integer kernels are many times faster than torch's here
        import numpy as np

        raw = words.numpy()
        magnitude = np.bitwise_and(raw, 0x7FFF)
        if raw.size == 0 or int(magnitude.max()) <= 0x7F80:
            return words
        return torch.from_numpy(np.where(magnitude > 0x7F80, np.bitwise_or(raw, 0x0040), raw))
    nan = torch.bitwise_and(words, 0x7FFF) > 0x7F80
    if not bool(nan.any()):
        return words
    return torch.where(nan, torch.bitwise_or(words, 0x0040), words)
