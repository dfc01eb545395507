"""The array operations the quantizers use, for numpy arrays and for torch tensors (CPU or CUDA) alike, so that one
copy of each type's arithmetic runs on either: ``namespace(array)`` gives the one that fits.

Every operation is one IEEE float32 operation per element, as C does it: a torch elementwise op on CUDA is its own
kernel (nothing is contracted into a multiply-add across ops), its division and square root are correctly rounded
and it keeps subnormals. One exception needs care: torch divides by a Python or numpy scalar as a multiplication by
its reciprocal (on CUDA, and ``scalar / tensor`` everywhere), so the arithmetic writes every division that has a
scalar side as ``xp.div(a, b)``, which makes both sides arrays on the same device first. Division of two arrays may
use ``/``. And torch's vectorized CPU square root is not always correctly rounded, so CPU tensors take numpy's.
"""

from __future__ import annotations

import contextlib

import numpy as np


def is_torch(array) -> bool:
    return type(array).__module__.startswith("torch")


def namespace(array):
    """The operations for ``array``'s kind (a numpy array or scalar, or a torch tensor)."""
    return TORCH if is_torch(array) else NUMPY


class _Numpy:
    """numpy's own functions, under the names the arithmetic uses."""

    where = staticmethod(np.where)
    abs = staticmethod(np.abs)
    sqrt = staticmethod(np.sqrt)
    trunc = staticmethod(np.trunc)
    floor = staticmethod(np.floor)
    sign = staticmethod(np.sign)
    isnan = staticmethod(np.isnan)
    maximum = staticmethod(np.maximum)
    concatenate = staticmethod(np.concatenate)
    tile = staticmethod(np.tile)
    stack = staticmethod(np.stack)

    @staticmethod
    def errstate():
        return np.errstate(all="ignore")

    @staticmethod
    def clip(values, low, high):
        return np.clip(values, low, high)

    @staticmethod
    def div(a, b):
        return np.divide(a, b, dtype=np.float32)

    @staticmethod
    def cap(values, high):
        """``MIN(high, v)`` with a scalar ``high``."""
        return np.minimum(values, high)

    @staticmethod
    def zeros(shape, dtype, like):
        return np.zeros(shape, dtype=dtype)

    @staticmethod
    def full(shape, value, dtype, like):
        return np.full(shape, value, dtype=dtype)

    @staticmethod
    def empty(shape, dtype, like):
        return np.empty(shape, dtype=dtype)

    @staticmethod
    def arange(start, stop, like):
        return np.arange(start, stop)

    @staticmethod
    def astype(values, dtype):
        return np.asarray(values).astype(dtype)

    @staticmethod
    def as_int32_bits(values):
        return values.view(np.int32)

    @staticmethod
    def half_bits(values):
        """float32 rounded to fp16 (nearest even, subnormals kept, overflow to infinity): the bits as int32."""
        return values.astype(np.float16).view(np.uint16).astype(np.int32)

    @staticmethod
    def from_half_bits(bits):
        return np.asarray(bits).astype(np.uint16).view(np.float16).astype(np.float32)

    @staticmethod
    def contiguous(values):
        return np.ascontiguousarray(values)

    @staticmethod
    def permute(values, *dims):
        return values.transpose(dims)

    @staticmethod
    def copy(values):
        return values.copy()

    @staticmethod
    def to_bool(values) -> bool:
        return bool(values)

    @staticmethod
    def fmin(values, bound):
        return np.fmin(values, np.float32(bound))

    @staticmethod
    def fmax(values, bound):
        return np.fmax(values, np.float32(bound))

    @staticmethod
    def table(values, like):
        """A constant numpy table, where ``like`` lives."""
        return values

    @staticmethod
    def sum_last(values):
        return values.sum(axis=-1)

    @staticmethod
    def fused_sums(values) -> bool:
        return False

    @staticmethod
    def asarray(values, like):
        return np.asarray(values)


class _Torch:
    """The same names over torch, on the device of the tensors they are given."""

    # whether CUDA tensors' in-order sums run as one Triton kernel each rather than one operation per
    # element (``kernels/seqsum.py``): the same bytes either way
    cuda_sums = True

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)

    @staticmethod
    def _dtype(dtype):
        import torch

        return {
            np.float32: torch.float32,
            np.int32: torch.int32,
            np.int64: torch.int64,
            np.uint8: torch.uint8,
            bool: torch.bool,
            np.intp: torch.int64,
        }[np.dtype(dtype).type if dtype is not bool else bool]

    @staticmethod
    def _scalar(value):
        return value.item() if isinstance(value, np.generic) else value

    @staticmethod
    def errstate():
        return contextlib.nullcontext()

    @staticmethod
    def sqrt(values):
        """Correctly rounded: CUDA's is; torch's vectorized CPU square root is not always, so CPU tensors take
        numpy's."""
        import torch

        if values.device.type == "cpu":
            return torch.from_numpy(np.sqrt(values.numpy()))
        return torch.sqrt(values)

    def where(self, condition, a, b):
        import torch

        return torch.where(condition, self._scalar(a), self._scalar(b))

    def clip(self, values, low, high):
        import torch

        return torch.clamp(values, self._scalar(low), self._scalar(high))

    def cap(self, values, high):
        import torch

        return torch.clamp(values, max=self._scalar(high))

    def maximum(self, a, b):
        import torch

        return torch.maximum(a, b)

    def div(self, a, b):
        import torch

        device = (a if is_torch(a) else b).device
        a = a if is_torch(a) else torch.tensor(float(a), dtype=torch.float32, device=device)
        b = b if is_torch(b) else torch.tensor(float(b), dtype=torch.float32, device=device)
        return torch.div(a, b)

    def zeros(self, shape, dtype, like):
        import torch

        return torch.zeros(shape, dtype=self._dtype(dtype), device=like.device)

    def full(self, shape, value, dtype, like):
        import torch

        return torch.full(shape, self._scalar(value), dtype=self._dtype(dtype), device=like.device)

    def empty(self, shape, dtype, like):
        import torch

        return torch.empty(shape, dtype=self._dtype(dtype), device=like.device)

    def arange(self, start, stop, like):
        import torch

        return torch.arange(start, stop, device=like.device)

    def astype(self, values, dtype):
        return values.to(self._dtype(dtype))

    @staticmethod
    def as_int32_bits(values):
        import torch

        return values.view(torch.int32)

    @staticmethod
    def half_bits(values):
        import torch

        return values.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF

    @staticmethod
    def from_half_bits(bits):
        import torch

        signed = bits - ((bits & 0x8000) << 1)  # 0..65535 as the int16 of the same bits
        return signed.to(torch.int16).view(torch.float16).to(torch.float32)

    @staticmethod
    def contiguous(values):
        return values.contiguous()

    @staticmethod
    def permute(values, *dims):
        return values.permute(*dims)

    @staticmethod
    def copy(values):
        return values.clone()

    @staticmethod
    def to_bool(values) -> bool:
        return bool(values.item())

    def fmin(self, values, bound):
        import torch

        return torch.fmin(values, torch.tensor(float(bound), dtype=values.dtype, device=values.device))

    def fmax(self, values, bound):
        import torch

        return torch.fmax(values, torch.tensor(float(bound), dtype=values.dtype, device=values.device))

    @staticmethod
    def table(values, like):
        import torch

        return torch.as_tensor(values, device=like.device)

    @staticmethod
    def sum_last(values):
        return values.sum(dim=-1)

    def fused_sums(self, values) -> bool:
        return self.cuda_sums and values.is_cuda and _triton_found()

    @staticmethod
    def asarray(values, like):
        import torch

        return torch.as_tensor(values, device=like.device)

    @staticmethod
    def concatenate(values, axis=0):
        import torch

        return torch.cat(values, dim=axis)

    @staticmethod
    def stack(values, axis=0):
        import torch

        return torch.stack(values, dim=axis)

    @staticmethod
    def tile(values, count):
        return values.repeat(count)


NUMPY = _Numpy()
TORCH = _Torch()


def _triton_found() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
