"""The reference of a tied base's head written apart, before any change: the input embeddings' reference."""

from __future__ import annotations

import dataclasses

BLAME = "the source tensor"


def reference(tensor, reader, device, context):
    return context.recompute(dataclasses.replace(tensor, recipe=tensor.recipe.base), reader, device)
