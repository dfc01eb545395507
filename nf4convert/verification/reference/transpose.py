"""The reference of a Conv1D layer's weight: the reference of the weight as quantized, (out, in), transposed. A
transpose needs the whole weight: one slice."""

from __future__ import annotations

import dataclasses

from .base import Slice, as_bytes
from .base import against as base_against


def _base(tensor):
    return dataclasses.replace(tensor, recipe=tensor.recipe.base, shape=tuple(reversed(tensor.shape)))


def against(tensor, device) -> str:
    return base_against(_base(tensor), device)


def slices(tensor, reader, device, context, piece_bytes: int):
    yield Slice(0, tensor.nbytes, lambda read, take: as_bytes(reference(tensor, reader, device, context)))


def reference(tensor, reader, device, context):
    base = _base(tensor)
    return context.recompute(base, reader, device).reshape(base.shape).T.contiguous()
