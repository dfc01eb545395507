"""The reference of a plain tensor: the source tensor, cast by torch where the dtype changes."""

from __future__ import annotations

from ...dtypes import DTYPES

BLAME = "the source tensor"


def reference(tensor, reader, device, context):
    """A NaN a cast makes is CUDA's canonical NaN (all bits but the sign), as the converter casts on every route
    (torch's own NaN bits depend on the CPU)."""
    from .cuda_arithmetic import canonical_nans

    source = reader.tensor(tensor.recipe.source)
    cast = source.to(DTYPES[tensor.dtype].torch)
    if cast.dtype != source.dtype and cast.is_floating_point():
        cast = canonical_nans(cast.contiguous())  # a cast is a new tensor: the source's bytes stay as read
    return cast
