"""The reference of a Conv1D layer's weight: the reference of the weight as quantized, (out, in), transposed."""

from __future__ import annotations

import dataclasses

BLAME = "bitsandbytes"


def reference(tensor, reader, device, context):
    base = dataclasses.replace(tensor, recipe=tensor.recipe.base, shape=tuple(reversed(tensor.shape)))
    return context.recompute(base, reader, device).reshape(base.shape).T.contiguous()
