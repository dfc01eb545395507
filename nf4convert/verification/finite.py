"""The NaN and ±inf values a merge makes where its base holds none, as verify reports them: peft's own merge makes
them too, so bit-equality alone passed a broken model. Recomputed from the references (``reference/``) only."""

from __future__ import annotations

import dataclasses


def made_by_merge(tensor, merged, reader, device, context) -> str | None:
    """What is wrong with merged tensor ``tensor`` whose reference values are ``merged`` (a torch tensor of its
    dtype): the NaN and ±inf among them that its base does not hold, or None where there are none. The base is
    recomputed only where ``merged`` holds any."""
    import torch

    bad = ~torch.isfinite(merged)
    if not bool(bad.any()):
        return None
    if "base" not in tensor.recipe.target.tensors:  # a saved weight replacing the base: all of it is the adapter's
        base = context.recompute(dataclasses.replace(tensor, recipe=tensor.recipe.base), reader, device)
        if tuple(base.shape) == tuple(bad.shape):
            bad &= torch.isfinite(base.to(bad.device))
    count = int(bad.sum())
    if not count:
        return None
    nan = int((torch.isnan(merged) & bad).sum())
    parts = (f"{nan} NaN" if nan else "", f"{count - nan} ±inf" if count - nan else "")
    made = " and ".join(part for part in parts if part)
    return f"the merge made {made} values that the base does not hold (a model with them is broken)"
