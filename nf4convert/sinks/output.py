"""The output's lifecycle: checks before anything is written, a temporary folder beside OUT, the side files (config,
index, carried files), the atomic move into place, and cleanup on any failure. A GGUF output is one file, written in
such a temporary folder and renamed into place from it. Stop signals wait while OUT is put in place (``held``).

OUT only ever appears complete: until the last rename it does not exist (or, with ``overwrite``, it is the
user's old folder, untouched). Every OSError on this path becomes one OutputError line.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from ..errors import STOP_SIGNALS, Interrupted, OutputError, Terminated
from ..paths import NAME_MAX
from ..sizes import size_text

PARTIAL_SUFFIX = ".nf4convert-partial"
OLD_SUFFIX = ".nf4convert-old"
PID_ROOM = len("-4194304")  # a staging name ends with the run's pid; Linux's largest
SPARE_BYTES = 64 << 20  # headroom on the disk beyond the output itself


def _beside(output: Path, suffix: str, room: int = 0) -> str:
    """The hidden name ``.OUT<suffix>`` of a folder beside OUT (staging, or the old OUT while it is replaced), with
    ``room`` bytes left for what follows. A name that would pass the file system's limit (an OUT name itself near
    it) keeps OUT's first bytes and a hash of the whole name, so that any OUT the file system takes can be written."""
    import hashlib

    name = f".{output.name}{suffix}"
    if len(os.fsencode(name)) + room <= NAME_MAX:
        return name
    digest = hashlib.sha256(os.fsencode(output.name)).hexdigest()[:16]
    keep = NAME_MAX - room - len(f".~{digest}{suffix}".encode())
    return f".{os.fsencode(output.name)[:keep].decode('utf-8', 'ignore')}~{digest}{suffix}"


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def check_destination(output: Path, *, overwrite: bool, file: bool = False) -> None:
    """OutputError if OUT is a file, or a non-empty folder and ``overwrite`` is off, or where it goes cannot be
    written (a read-only file system, no permission): found by a dry run too, not by the first write. ``file``: OUT is
    one file (a GGUF), refused if it is a folder, or a file and ``overwrite`` is off."""
    if output.is_symlink():
        raise OutputError(
            f"{output}: is a symbolic link; give the {'file' if file else 'folder'} it points to, or a new name"
        )
    folder = _existing_ancestor(output)  # first: a symlink loop on the way is one line
    cwd = Path.cwd().resolve()
    if output.name in ("", ".", "..") or output.resolve() == cwd or output.resolve() in cwd.parents:
        raise OutputError(f"{output}: is the current folder or holds it; give the output a folder name of its own")
    try:
        if file and output.is_dir():
            raise OutputError(f"{output}: is a folder; a GGUF output is one file (give a new file name)")
        if file and output.exists() and not overwrite:
            raise OutputError(f"{output}: exists", option="overwrite")
        if not file and output.exists() and not output.is_dir():
            raise OutputError(f"{output}: exists and is not a folder")
        if output.is_dir() and any(output.iterdir()) and not overwrite:
            raise OutputError(f"{output}: exists and is not empty", option="overwrite")
    except OSError as error:
        raise OutputError(f"{output}: cannot be read ({_reason(error)})") from None
    if not folder.is_dir():
        raise OutputError(f"{folder}: is a file, not a folder; the output cannot be made in it")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(
            f"{folder}: cannot be written (a read-only file system or no permission); choose another output"
        )


def holds_output(output: Path) -> bool:
    """Whether OUT is there as a conversion would refuse to write it without ``overwrite``: a folder, not empty."""
    try:
        return output.is_dir() and not output.is_symlink() and any(output.iterdir())
    except OSError:
        return False  # one that cannot be read: the conversion's own checks say so


def _existing_ancestor(output: Path) -> Path:
    """The folder OUT is made in: its nearest existing ancestor (OUT's parents may be created), resolved. A symbolic
    link loop on the way is one line, on every Python (from 3.13 ``resolve`` no longer raises for one)."""
    import errno

    for folder in output.absolute().parents:
        try:
            os.stat(folder)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise OutputError(f"{folder}: cannot be resolved (a symbolic link loop)") from None
            continue  # missing (or not a folder): its parent then
        return folder.resolve()
    return Path(output.absolute().anchor)


def placed(path: Path, folder: Path) -> str | None:
    """Where ``path`` lies against ``folder``, both resolved: "is" it, "holds" it, is "inside" it, or None (apart)."""
    path, folder = path.resolve(), folder.resolve()
    if path == folder:
        return "is"
    if path in folder.parents:
        return "holds"
    return "inside" if folder in path.parents else None


def check_not_source(output: Path, source: Path, what: str = "the source checkpoint's") -> None:
    """OutputError if OUT is the source folder, holds it, or is inside it (even with ``overwrite``); ``what`` names
    whose folder it is ("the adapter's")."""
    where = placed(output, source)
    if where in ("is", "holds"):
        raise OutputError(f"{output}: is {what} folder (or holds it); choose another output")
    if where == "inside":
        raise OutputError(f"{output}: is inside {what} folder {source.resolve()}; choose another output")


def free_space(output: Path) -> int:
    """Free bytes on the file system OUT would be written to (its nearest existing ancestor); creates nothing."""
    folder = _existing_ancestor(output)
    try:
        return shutil.disk_usage(folder).free
    except OSError as error:
        raise OutputError(f"{folder}: cannot be read ({_reason(error)})") from None


def space_needed(output_bytes: int) -> int:
    """What OUT's file system must have free for an output of ``output_bytes``: those, and ``SPARE_BYTES`` more."""
    return output_bytes + SPARE_BYTES


def check_free_space(output: Path, needed: int, free: int | None = None) -> None:
    """OutputError unless OUT's file system has ``space_needed(needed)`` bytes free (``free``: as measured already)."""
    free = free_space(output) if free is None else free
    if free < space_needed(needed):
        raise OutputError(
            f"{_existing_ancestor(output)}: {size_text(free)} free, the output needs "
            f"{size_text(space_needed(needed))} ({size_text(needed)} and {size_text(SPARE_BYTES)} of headroom)"
        )


@contextlib.contextmanager
def staging(output: Path):
    """A fresh temporary folder beside OUT, this run's own (two runs to one OUT never share one); removed if the
    block fails in any way (Ctrl-C too). Those of runs that were killed outright are removed first."""
    import glob

    stem = _beside(output, PARTIAL_SUFFIX, room=PID_ROOM)
    temporary = output.parent / f"{stem}-{os.getpid()}"
    try:
        for stale in output.parent.glob(f"{glob.escape(stem)}-*"):  # OUT's own, not x*'s
            if stale.name.rpartition("-")[0] == temporary.name.rpartition("-")[0] and not _alive(
                stale.name.rpartition("-")[2]
            ):
                shutil.rmtree(stale, ignore_errors=True)
    except OSError as error:
        raise OutputError(f"{output}: cannot be written ({_reason(error)})") from None
    made = _missing_parents(temporary)  # the folders above OUT this run creates: they go too if nothing is kept
    try:  # from the mkdir on: a signal that lands just after it must not leave the folder behind
        try:
            temporary.mkdir(parents=True)
        except OSError as error:
            raise OutputError(f"{output}: cannot be written ({_reason(error)})") from None
        yield temporary
    except OSError as error:
        _remove(temporary, made)
        raise OutputError(f"{output}: writing failed ({_reason(error)}); nothing was written") from None
    except BaseException:
        _remove(temporary, made)
        raise


def _missing_parents(folder: Path) -> list[Path]:
    """The folders above ``folder`` that do not exist yet, deepest first."""
    missing = []
    for parent in folder.parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing


def _remove(temporary: Path, made: list[Path]) -> None:
    """A run's staging folder, and the parents it made for it (deepest first) that nothing else has filled since."""
    shutil.rmtree(temporary, ignore_errors=True)
    for parent in made:
        try:
            parent.rmdir()
        except FileNotFoundError:
            continue  # not made yet (the failure came first)
        except OSError:
            break  # not empty (another run put something there), or not ours to remove: it, and those above, stay


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (ValueError, OSError):  # not a pid of ours to judge (or not ours to signal): leave its folder alone
        return True
    return True


@dataclass(frozen=True)
class Leftover:
    """A staging folder that a run killed outright (``kill -9``, the out-of-memory killer, a power cut) left beside
    its OUT: no process of its number runs any more."""

    path: Path
    pid: int
    own: bool  # OUT's own: a run into OUT removes it

    def note(self, *, removed: bool = False) -> str:
        """One line naming it: removed (by a run into its OUT), or how to remove it."""
        killed = f"left by a conversion that was killed (process {self.pid} is gone)"
        if removed:
            return f"removed {self.path}, {killed}"
        remove = f"rm -rf {shlex.quote(str(self.path))}"
        how = f"a conversion into its OUT removes it, or: {remove}" if self.own else f"remove it with: {remove}"
        return f"{self.path}: {killed}; {how}"


def leftovers(output: Path) -> list[Leftover]:
    """The staging folders of killed runs beside OUT (in its parent folder), whichever OUT they were for; OUT's own are
    marked ``own``. A parent that cannot be read has none that can be named."""
    own = _beside(output, PARTIAL_SUFFIX, room=PID_ROOM)
    found = []
    try:
        for entry in sorted(output.parent.iterdir()):
            stem, _, pid = entry.name.rpartition("-")
            if stem.startswith(".") and stem.endswith(PARTIAL_SUFFIX) and pid.isdigit() and entry.is_dir():
                if not entry.is_symlink() and not _alive(pid):
                    found.append(Leftover(entry, int(pid), stem == own))
    except OSError:
        return []
    return found


def move_file_into_place(temporary: Path, output: Path, *, overwrite: bool = False) -> None:
    """Rename the finished file ``temporary / OUT's name`` (written in its staging folder) to OUT, replacing an old OUT
    in the same rename when ``overwrite``, then remove the emptied staging folder. An OUT that another run wrote
    meanwhile is not replaced unless ``overwrite``."""
    if output.exists() and not overwrite:
        raise OutputError(
            f"{output}: appeared while converting (another run?); nothing of this run was kept", option="overwrite"
        )
    os.replace(temporary / output.name, output)
    temporary.rmdir()


def move_into_place(temporary: Path, output: Path, *, overwrite: bool = False) -> None:
    """Rename the finished folder to OUT; an old OUT (overwrite) is removed only after that. An OUT that another
    run wrote meanwhile is not replaced unless ``overwrite``."""
    old = None
    if output.exists() and not overwrite and (not output.is_dir() or any(output.iterdir())):
        raise OutputError(
            f"{output}: appeared while converting (another run?); nothing of this run was kept", option="overwrite"
        )
    if output.exists():
        old = output.parent / _beside(output, OLD_SUFFIX)
        shutil.rmtree(old, ignore_errors=True)
        output.rename(old)
    try:
        temporary.rename(output)
    except BaseException:  # an OSError, or Ctrl-C / SIGTERM between the two renames: the user's OUT comes back
        if old is not None and not output.exists():
            old.rename(output)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def held(output: Path):
    """SIGINT, SIGTERM and SIGHUP wait while OUT is put in place and the run winds down (main thread only), so that
    none can leave the user's OUT half-replaced or a complete OUT reported as not written. A signal that came is
    delivered at the end, its exception's ``output_complete`` set to OUT when the block finished."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {number: signal.signal(number, lambda signum, frame: came.append(signum)) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if came:
        handler = previous[came[0]]
        if handler is signal.SIG_DFL:
            signal.raise_signal(came[0])  # the default action: the process ends (OUT is complete)
        elif callable(handler):
            try:
                handler(came[0], None)
            except (Interrupted, Terminated) as stop:
                stop.output_complete = output
                raise
