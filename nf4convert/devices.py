"""Where the work runs: the one place a ``device`` option becomes a torch device."""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import sys
from pathlib import Path

from .errors import ArgumentError, DependencyError

AMD_GPU = "an AMD GPU (ROCm), where the kernel, written with NVIDIA's PTX, cannot run"


def on_amd_gpu() -> bool:
    """Whether torch's "cuda" device is an AMD GPU (a ROCm build of torch)."""
    import torch

    return getattr(torch.version, "hip", None) is not None


def has_triton() -> bool:
    """Whether Triton, the CUDA kernel's compiler, is installed (the package requires it on Linux only)."""

    return importlib.util.find_spec("triton") is not None


def no_triton(what: str) -> DependencyError:
    return DependencyError(
        f"{what} needs Triton, which is not installed (pip install triton; on Windows, triton-windows); "
        "the CPU path (--device cpu, backend='cpu') works without it"
    )


def gpu_driver_present() -> bool:
    """Whether this machine shows a GPU driver's device files (NVIDIA's /dev/nvidia*, AMD's /dev/kfd, WSL2's /dev/dxg,
    through which Windows lends its GPUs): without them torch sees no CUDA device, so ``auto`` picks the CPU without
    importing torch (seconds with a CUDA build)."""

    return (
        bool(glob.glob("/dev/nvidia[0-9]*"))
        or any(os.path.exists(f"/dev/{name}") for name in ("kfd", "dxg"))
        or not os.path.isdir("/dev")
    )


def pick_device(device: str, *, kernel: bool = True):
    """``auto`` (an NVIDIA GPU when there is one and, for our ``kernel``, Triton to compile it), ``cpu``, ``cuda`` or
    ``cuda:N`` -> torch.device; ArgumentError otherwise, and for ``cuda`` on an AMD GPU; DependencyError for ``cuda``
    without Triton where the kernel runs (``kernel=False``: verify, whose references are bitsandbytes and peft).
    Where torch is not needed to tell (``cpu``; ``auto`` on Linux without a GPU driver) and not imported yet, the
    string "cpu": the CPU route runs without torch."""

    if device == "cpu" or (device == "auto" and sys.platform.startswith("linux") and not gpu_driver_present()):
        return "cpu" if sys.modules.get("torch") is None else sys.modules["torch"].device("cpu")
    import torch

    if device == "auto":
        triton = has_triton() if kernel else True
        return torch.device("cuda" if torch.cuda.is_available() and not on_amd_gpu() and triton else "cpu")
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
    if chosen.type == "cuda" and kernel and not has_triton():
        raise no_triton(f"device {device!r}")
    return chosen


def cpu_cores(cgroup_root: str = "/sys/fs/cgroup", own_cgroup: str = "/proc/self/cgroup") -> int:
    """The cores this process may keep busy: those it may run on (``sched_getaffinity``), capped by a container's CPU
    quota (cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, of this process's cgroup and
    each one above it; a quota of 1.5 cores counts 2). At least 1; a cgroup file that cannot be read or parsed is
    no quota."""

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        lines = Path(own_cgroup).read_text().splitlines()
    except OSError:
        return max(cores, 1)
    root = Path(cgroup_root)
    folders = []  # (a cgroup's folder, "v1" or None for v2)
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2].startswith("/"):
            continue
        hierarchy, controllers, path = parts
        relative = Path(path.lstrip("/"))
        if hierarchy == "0" and controllers == "":  # v2: one tree
            folders += [(root / chain, None) for chain in (relative, *relative.parents)]
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own tree; in a container, often its root
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                folders += [(mount / chain, "v1") for chain in (relative, *relative.parents)]
    for folder, version in dict.fromkeys(folders):
        try:
            if version is None:
                quota, period = (folder / "cpu.max").read_text().split()[:2]
            else:
                quota, period = (
                    (folder / name).read_text().strip() for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us")
                )
            if quota in ("max", "-1") or int(period) <= 0 or int(quota) <= 0:
                continue
            cores = min(cores, math.ceil(int(quota) / int(period)))
        except (OSError, ValueError):
            continue
    return max(cores, 1)
