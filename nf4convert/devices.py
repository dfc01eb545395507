"""Where the work runs: the one place a ``device`` option becomes a torch device."""

from __future__ import annotations

from .errors import ArgumentError


AMD_GPU = "an AMD GPU (ROCm), where the kernel, written with NVIDIA's PTX, cannot run"


def on_amd_gpu() -> bool:
    """Whether torch's "cuda" device is an AMD GPU (a ROCm build of torch)."""
    import torch

    return getattr(torch.version, "hip", None) is not None


def pick_device(device: str):
    """``auto`` (an NVIDIA GPU when there is one), ``cpu``, ``cuda`` or ``cuda:N`` -> torch.device; ArgumentError
    otherwise, and for ``cuda`` on an AMD GPU."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() and not on_amd_gpu() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise ArgumentError(f"device {device!r} is not cpu, cuda or cuda:N", option="device") from None
    if chosen.type not in ("cpu", "cuda"):
        raise ArgumentError(f"device {device!r} is not cpu, cuda or cuda:N", option="device")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ArgumentError(f"device {device!r}: no CUDA GPU is available", option="device")
    if chosen.type == "cuda" and on_amd_gpu():
        raise ArgumentError(f"device {device!r}: {AMD_GPU}; use cpu", option="device")
    if chosen.type == "cuda" and chosen.index is not None and chosen.index >= torch.cuda.device_count():
        raise ArgumentError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA GPUs", option="device")
    return chosen
