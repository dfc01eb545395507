"""The NaN and ±inf values a LoRA merge makes: those of the merged weight that its base does not hold (a NaN or an
inf in ``lora_A`` / ``lora_B``, or a change beyond the output dtype's range). peft merges them silently; a model with
them is broken, so a conversion refuses it unless asked to keep them (``allow_non_finite``).
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError


def non_finite(base):
    """Where ``base`` (a torch tensor) holds NaN or ±inf, as a bool tensor; None where it holds none (most weights: one
    reduction, no mask kept)."""
    import torch

    if base.numel() == 0 or bool(torch.isfinite(base).all()):
        return None
    return ~torch.isfinite(base)


def made(merged, before) -> tuple[int, int]:
    """(NaN, ±inf) counts of the merged weight's values that are not finite where its base's were (``before``: the
    base's ``non_finite``, None for a base with none or of another shape, as a saved weight that replaces it)."""
    import torch

    bad = ~torch.isfinite(merged)
    if before is not None and before.shape == bad.shape:
        bad &= ~before.to(bad.device)
    count = int(bad.sum())
    if count == 0:
        return 0, 0
    nan = int((torch.isnan(merged) & bad).sum())
    return nan, count - nan


def described(nan: int, inf: int) -> str:
    return " and ".join(part for part in (f"{nan} NaN" if nan else "", f"{inf} ±inf" if inf else "") if part)


def refusal(adapter: Path, name: str, nan: int, inf: int, dtype: str) -> CheckpointError:
    """The one line refusing a merge that makes ``nan`` NaN and ``inf`` ±inf values in tensor ``name`` of ``dtype``
    (safetensors' name)."""
    if dtype == "F16" and not nan:
        why = "a change beyond fp16's range, which --dtype bf16 or fp32 may hold, or an inf in its lora_A/lora_B"
    else:
        why = "a NaN or an inf in its lora_A/lora_B, or a change beyond the dtype's range"
    return CheckpointError(
        f"{adapter}: merging it makes {described(nan, inf)} values in '{name}' that the base does not hold ({why}); "
        "a model with them is broken",
        option="allow_non_finite",
    )
