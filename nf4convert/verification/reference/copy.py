"""The reference of a plain tensor: the source tensor, cast by torch where the dtype changes."""

from __future__ import annotations

from ...dtypes import DTYPES
from .base import Slice, as_bytes, whole


def against(tensor, device) -> str:
    return "the source tensor"


def slices(tensor, reader, device, context, piece_bytes: int):
    """Runs of whole elements, on the CPU whatever the device (as the converter casts on every route)."""
    source = tensor.recipe.source
    source_size, target_size = DTYPES[source.dtype].itemsize, DTYPES[tensor.dtype].itemsize
    n_elements = source.nbytes // source_size
    step = max(1, piece_bytes // max(source_size, target_size))
    for first in range(0, n_elements, step):
        count = min(step, n_elements - first)
        yield Slice(first * target_size, count * target_size, _cast(tensor, first, count))


def _cast(tensor, first: int, count: int):
    def make(read, take):
        """A NaN a cast makes is CUDA's canonical NaN (all bits but the sign), as the converter casts on every route
        (torch's own NaN bits depend on the CPU)."""
        from .cuda_arithmetic import canonical_nans

        source = tensor.recipe.source
        size = DTYPES[source.dtype].itemsize
        values = read(source, first * size, count * size).view(DTYPES[source.dtype].torch)
        if source.dtype == tensor.dtype:
            return as_bytes(values)
        cast = take(count * DTYPES[tensor.dtype].itemsize).view(DTYPES[tensor.dtype].torch).copy_(values)
        if cast.is_floating_point():
            cast = canonical_nans(cast)  # a cast is a new tensor: the source's bytes stay as read
        return as_bytes(cast)

    return make


def reference(tensor, reader, device, context):
    return whole(tensor, reader, device, context)
