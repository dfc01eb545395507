"""Who owns a staging folder: a lock the live run holds on a file inside it, so that a run never takes another's folder
for a killed run's, whatever process namespace (a container) or host (a shared NFS volume) that run lives in.

The owner file names the host, the boot of the kernel it runs on (Linux's ``boot_id``: containers on one host share
it) and the process; the run holds an exclusive ``flock`` on it until it ends, which the kernel drops when the process
dies, however it dies. A folder's owner is *provably gone* only where this run's kernel holds the lock state: the
owner file names this boot, and the lock can be taken. Anything else (another host or boot, whose locks this kernel
may not see; a folder without an owner file: an older version's, or one being made) is left alone, named for the user.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

OWNER_FILE = ".nf4convert-owner"
BEING_MADE_SECONDS = 60  # a folder without an owner file this young is a run's that is making it


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def _flock():
    try:
        import fcntl
    except ImportError:  # no flock here (Windows): no owner is ever provably gone
        return None
    return fcntl


class Owner:
    """This run's hold on its staging folder: the owner file, locked while the run lives."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._descriptor: int | None = None

    @classmethod
    def claim(cls, folder: Path) -> "Owner":
        """Write and lock ``folder``'s owner file (the folder was just made by this run)."""
        owner = cls(folder)
        descriptor = os.open(folder / OWNER_FILE, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0))
        owner._descriptor = descriptor
        fcntl = _flock()
        if fcntl is not None:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        record = f"host={socket.gethostname()}\nboot={_boot_id() or ''}\npid={os.getpid()}\n"
        os.write(descriptor, record.encode())
        return owner

    def unlink(self) -> None:
        """The owner file gone from the folder (before the folder becomes OUT); the lock stays held until ``close``."""
        try:
            os.unlink(self.folder / OWNER_FILE)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """The lock released (the folder is gone, or OUT)."""
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None


@dataclass(frozen=True)
class Verdict:
    """What can be told of a staging folder's owner: alive (its lock is held), provably gone, or not known here."""

    gone: bool
    alive: bool
    owner: str  # for messages: "process 123 on host h"

    @property
    def unknown(self) -> bool:
        return not self.gone and not self.alive


def _record(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def verdict(folder: Path, pid: int | None) -> Verdict:
    """Whether ``folder``'s owner is alive, provably gone, or unknown from here (``pid``: the one its name gives)."""
    path = folder / OWNER_FILE
    fcntl = _flock()
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return _without_owner_file(folder, pid)
    except OSError:
        return Verdict(False, False, f"process {pid}" if pid is not None else "another run")
    try:
        record = _record(os.read(descriptor, 4096).decode("utf-8", "replace"))
        owner = f"process {record.get('pid', pid)} on host {record.get('host') or '?'}"
        if fcntl is None:
            return Verdict(False, False, owner)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return Verdict(False, True, owner)  # held: the run lives
        fcntl.flock(descriptor, fcntl.LOCK_UN)
        same_kernel = bool(record.get("boot")) and record.get("boot") == _boot_id()
        return Verdict(same_kernel, False, owner)
    finally:
        os.close(descriptor)


def _without_owner_file(folder: Path, pid: int | None) -> Verdict:
    """A folder with no owner file: one a run is making (young), or an older version's (named by its process alone:
    alive here, or unknown, never provably gone, since the process may live in another namespace)."""
    try:
        young = time.time() - folder.stat().st_mtime < BEING_MADE_SECONDS
    except OSError:
        young = False
    if young or (pid is not None and _alive_here(pid)):
        return Verdict(False, True, f"process {pid}")
    return Verdict(False, False, f"process {pid}" if pid is not None else "another run")


def _alive_here(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (ValueError, OSError):  # not ours to signal: someone's
        return True
    return True
