"""A run's scratch folder in the system's temporary folder (TMPDIR): owned by a lock the run holds (``ownership.py``),
removed when the run ends, and, since a run killed outright (SIGKILL, out of memory) cannot remove its own, those of
runs provably gone are removed by the next run that makes one of the same kind."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from . import ownership


@contextlib.contextmanager
def scratch_folder(kind: str) -> Iterator[Path]:
    """A fresh folder ``nf4convert-KIND-PID-XXXX`` in TMPDIR, held by this run, removed after the block (and its
    leftovers of killed runs removed before)."""
    root = Path(tempfile.gettempdir())
    _remove_stale(root, kind)
    folder = Path(tempfile.mkdtemp(prefix=f"nf4convert-{kind}-{os.getpid()}-", dir=root))
    owner = None
    try:
        owner = ownership.Owner.claim(folder)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        if owner is not None:
            owner.close()


def _remove_stale(root: Path, kind: str) -> None:
    for stale in root.glob(f"nf4convert-{glob.escape(kind)}-*"):
        pid = _pid_of(stale.name, kind)
        if pid is None or pid == os.getpid() or stale.is_symlink() or not stale.is_dir():
            continue
        with contextlib.suppress(OSError):
            if ownership.verdict(stale, pid).gone:
                shutil.rmtree(stale, ignore_errors=True)


def _pid_of(name: str, kind: str) -> int | None:
    """The process a scratch folder's name gives (``nf4convert-KIND-PID-XXXX``), or None for any other name."""
    pid, dash, _ = name[len(f"nf4convert-{kind}-") :].partition("-")
    return int(pid) if dash and pid.isascii() and pid.isdigit() else None
