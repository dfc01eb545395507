"""Output bytes against their reference, bit for bit: one piece at a time, tallied per tensor."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..safetensors_io.read import TensorInfo


def described(tensor, info: TensorInfo) -> str | None:
    """What is wrong with output tensor ``info``'s dtype or shape against planned ``tensor``'s, or None."""
    if info.dtype != tensor.dtype or tuple(info.shape) != tuple(tensor.shape):
        return f"{info.dtype} {list(info.shape)} in the output, {tensor.dtype} {list(tensor.shape)} expected"
    return None


def differing(expected, got, itemsize: int) -> int:
    """How many elements of ``itemsize`` bytes differ in any bit between ``expected`` (flat uint8, on the CPU or a GPU)
    and ``got`` (flat uint8 on the CPU, as many bytes): compared where ``expected`` lies."""
    import torch

    if expected.device.type != "cpu":
        got = got.to(expected.device, non_blocking=True)  # the caller's buffer is reused only after this returns
        if torch.equal(expected, got):
            return 0
    else:
        import numpy as np

        first, second = expected.numpy(), got.numpy()
        if first.size % 8 == 0:  # as 8-byte words: a pass of an eighth as many comparisons
            first, second = first.view(np.int64), second.view(np.int64)
        if np.array_equal(first, second):  # numpy's: many times torch.equal on the CPU
            return 0
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    return int((expected.view(integer) != got.view(integer)).sum())


@dataclass
class Tally:
    """One tensor's comparison so far: elements differing, and why its reference could not be computed (if so)."""

    nbytes: int
    itemsize: int
    against: str
    mismatches: int = 0
    compared: int = 0  # bytes
    failure: str | None = None
    non_finite: int = 0  # NaN or ±inf values of a merge's reference (compare.py leaves to finite.py what they mean)

    def problem(self) -> str | None:
        if self.failure is not None:
            return f"{self.against} could not recompute it ({self.failure})"
        if self.mismatches:
            return f"{self.mismatches} of {self.nbytes // self.itemsize} elements differ from {self.against}"
        if self.compared != self.nbytes:  # never an OK for bytes no one looked at
            return f"only {self.compared} of its {self.nbytes} bytes were compared"
        return None


class Tallies:
    """Every tensor's tally, added to from several threads."""

    def __init__(self):
        self.by_name: dict[str, Tally] = {}
        self._lock = threading.Lock()

    def start(self, name: str, nbytes: int, itemsize: int, against: str) -> None:
        self.by_name[name] = Tally(nbytes, itemsize, against)

    def add(self, name: str, mismatches: int, nbytes: int) -> None:
        with self._lock:
            self.by_name[name].mismatches += mismatches
            self.by_name[name].compared += nbytes

    def count_non_finite(self, name: str, count: int) -> None:
        with self._lock:
            self.by_name[name].non_finite += count

    def fail(self, name: str, error: BaseException) -> None:
        """The reference library refused this input: a finding about the tensor, not a crash."""
        text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        with self._lock:
            tally = self.by_name[name]
            tally.failure = tally.failure or text
