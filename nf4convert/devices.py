"""Where the work runs: the one place a ``device`` option becomes a torch device."""

from __future__ import annotations

from .errors import ArgumentError


def pick_device(device: str):
    """``auto`` (the GPU when there is one), ``cpu``, ``cuda`` or ``cuda:N`` -> torch.device; ArgumentError otherwise."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise ArgumentError(f"device {device!r} is not cpu, cuda or cuda:N", option="device") from None
    if chosen.type not in ("cpu", "cuda"):
        raise ArgumentError(f"device {device!r} is not cpu, cuda or cuda:N", option="device")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ArgumentError(f"device {device!r}: no CUDA GPU is available", option="device")
    if chosen.type == "cuda" and chosen.index is not None and chosen.index >= torch.cuda.device_count():
        raise ArgumentError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA GPUs", option="device")
    return chosen
