"""The reference of a tied base's head written apart, before any change: the input embeddings' reference."""

from __future__ import annotations

import dataclasses

from .base import against as base_against


def _base(tensor):
    return dataclasses.replace(tensor, recipe=tensor.recipe.base)


def against(tensor, device) -> str:
    return base_against(_base(tensor), device)


def slices(tensor, reader, device, context, piece_bytes: int):
    return context.slices(_base(tensor), reader, device, piece_bytes)


def reference(tensor, reader, device, context):
    return context.recompute(_base(tensor), reader, device)
