"""What every reference module shares: the slice it answers with, and a leaf kind's reference made whole."""

from __future__ import annotations

from typing import Callable, NamedTuple


class Slice(NamedTuple):
    """Bytes ``[offset, offset + nbytes)`` of an output tensor as the reference computes them: ``make(read, take)``
    returns them as a flat uint8 tensor, on the CPU or the device that computed them. ``read(info, first, count)``
    gives bytes of a source tensor as a uint8 CPU tensor, ``take(nbytes)`` CPU memory to compute into (the caller
    decides where both lie and when they are reused: after the slice is compared)."""

    offset: int
    nbytes: int
    make: Callable


def whole(tensor, reader, device, context):
    """A leaf kind's reference made whole from its slices, as a tensor of ``tensor``'s dtype and shape (on the device
    that computed it): one copy of the tensor, not one per slice."""
    import torch

    from ...dtypes import DTYPES

    made = None
    for piece in context.slices(tensor, reader, device, 1 << 24):
        computed = piece.make(
            lambda info, first, count: reader.read(info, first, count),
            lambda nbytes: torch.empty(nbytes, dtype=torch.uint8),
        )
        if made is None:
            made = torch.empty(tensor.nbytes, dtype=torch.uint8, device=computed.device)
        made[piece.offset : piece.offset + piece.nbytes].copy_(computed)
    if made is None:  # no elements
        made = torch.empty(0, dtype=torch.uint8)
    return made.view(DTYPES[tensor.dtype].torch).reshape(tensor.shape)


def as_bytes(values):
    """A tensor's bytes, flat uint8 (its own memory, no copy where it is contiguous)."""
    import torch

    return values.contiguous().reshape(-1).view(torch.uint8)
