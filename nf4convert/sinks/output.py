"""The output's lifecycle: checks before anything is written, a temporary folder beside OUT, the side files (config,
index, carried files), the atomic move into place, and cleanup on any failure. A GGUF output is one file, written in
such a temporary folder and renamed into place from it. Stop signals wait while OUT is put in place (``held``), and
while a failed run's temporary folder is removed.

A temporary (staging) folder is owned by the run that made it through a lock it holds on a file inside
(``ownership.py``): another run removes it only once its owner is provably gone, never by a process number alone,
which means nothing in another container or on another host.

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

from ..errors import STOP_SIGNALS, Interrupted, Nf4ConvertError, OutputError, Terminated
from ..paths import NAME_MAX
from ..sizes import size_text
from . import ownership

PARTIAL_SUFFIX = ".nf4convert-partial"
OLD_SUFFIX = ".nf4convert-old"
TOKEN_CHARS = 8  # a staging name's random part: two runs of one pid (in two containers) never share a name
PID_ROOM = len("-4194304-") + TOKEN_CHARS  # a staging name ends with the run's pid (Linux's largest) and the token
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


def check_destination(output: Path, *, overwrite: bool, file: bool = False, sources=(), adapter=None) -> None:
    """OutputError if OUT is a file, or a non-empty folder and ``overwrite`` is off, or where it goes cannot be
    written (a read-only file system, no permission): found by a dry run too, not by the first write. ``file``: OUT is
    one file (a GGUF), refused if it is a folder, or a file and ``overwrite`` is off. ``sources``: local folders the
    run reads (``check_not_source``), and ``adapter``'s (named as the adapter's), checked before OUT's contents: that
    reason is the one to give."""
    if output.is_symlink():
        raise OutputError(
            f"{output}: is a symbolic link; give the {'file' if file else 'folder'} it points to, or a new name"
        )
    folder = _existing_ancestor(output)  # first: a symlink loop on the way is one line
    cwd = Path.cwd().resolve()
    if output.name in ("", ".", "..") or output.resolve() == cwd or output.resolve() in cwd.parents:
        raise OutputError(f"{output}: is the current folder or holds it; give the output a folder name of its own")
    for source in sources:
        check_not_source(output, source)
    if adapter is not None:
        check_not_source(output, adapter, "the adapter's")
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


def holds_output(output: Path, *, file: bool = False) -> bool:
    """Whether OUT is there as a conversion would refuse to write it without ``overwrite``: a folder, not empty; or
    (``file``: the output is one file, a GGUF) a file."""
    try:
        if file:
            return output.is_file() and not output.is_symlink()
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


def _staging_name(name: str) -> tuple[str, int | None] | None:
    """(stem, pid) of a staging folder's name ``<stem>-<pid>-<token>`` (or an older version's ``<stem>-<pid>``),
    or None for another name."""
    stem, _, tail = name.rpartition("-")
    if len(tail) == TOKEN_CHARS and all(c in "0123456789abcdef" for c in tail):
        stem, _, pid = stem.rpartition("-")
        return (stem, int(pid)) if pid.isdigit() else None
    return (stem, int(tail)) if tail.isdigit() else None


_OWNERS: dict[Path, ownership.Owner] = {}  # this process's staging folders and their locks


@contextlib.contextmanager
def staging(output: Path):
    """A fresh temporary folder beside OUT, this run's own (two runs to one OUT never share one, whatever their
    process numbers), locked while the run lives; removed if the block fails in any way (Ctrl-C too, and a second
    one while it is removed). Those of OUT's runs that are provably gone (``ownership``) are removed first."""
    import glob
    import secrets

    stem = _beside(output, PARTIAL_SUFFIX, room=PID_ROOM)
    temporary = output.parent / f"{stem}-{os.getpid()}-{secrets.token_hex(TOKEN_CHARS // 2)}"
    try:
        for stale in output.parent.glob(f"{glob.escape(stem)}-*"):  # OUT's own, not x*'s
            named = _staging_name(stale.name)
            if named is not None and named[0] == stem and stale.is_dir() and not stale.is_symlink():
                if ownership.verdict(stale, named[1]).gone:
                    shutil.rmtree(stale, ignore_errors=True)
    except OSError as error:
        raise OutputError(f"{output}: cannot be written ({_reason(error)})") from None
    made = _missing_parents(temporary)  # the folders above OUT this run creates: they go too if nothing is kept
    owner = None
    try:  # from the mkdir on: a signal that lands just after it must not leave the folder behind
        try:
            temporary.mkdir(parents=True)
            owner = _OWNERS[temporary] = ownership.Owner.claim(temporary)
        except OSError as error:
            raise OutputError(f"{output}: cannot be written ({_reason(error)})") from None
        yield temporary
    except OSError as error:
        left = _remove(temporary, made)
        raise OutputError(f"{output}: writing failed ({_reason(error)}); {_what_is_left(left)}") from None
    except (Interrupted, Terminated) as stop:
        stop.left = _remove(temporary, made)
        raise
    except Nf4ConvertError as error:
        left = _remove(temporary, made)
        if left is None:
            raise
        said = type(error)(f"{error}; {_what_is_left(left)}", option=error.option)
        said.__dict__.update({key: value for key, value in error.__dict__.items() if key != "option"})
        raise said from None
    except BaseException:
        _remove(temporary, made)
        raise
    finally:
        _OWNERS.pop(temporary, None)
        if owner is not None:
            owner.close()


def _what_is_left(left: Path | None) -> str:
    if left is None:
        return "nothing was written"
    return f"{left} is left (it could not be removed): remove it with: rm -rf {shlex.quote(str(left))}"


def _missing_parents(folder: Path) -> list[Path]:
    """The folders above ``folder`` that do not exist yet, deepest first."""
    missing = []
    for parent in folder.parents:
        if parent.exists():
            break
        missing.append(parent)
    return missing


def _remove(temporary: Path, made: list[Path]) -> Path | None:
    """A run's staging folder, and the parents it made for it (deepest first) that nothing else has filled since.
    Stop signals wait until it is done (main thread): a second Ctrl-C stopped the removal halfway. Returns the folder
    if it is still there (it could not be removed), else None."""
    with _signals_waiting():
        shutil.rmtree(temporary, ignore_errors=True)
        _remove_parents(made)
    return temporary if os.path.lexists(temporary) else None


@contextlib.contextmanager
def _signals_waiting():
    """SIGINT, SIGTERM and SIGHUP recorded, not acted on, for the block (main thread only): they come while a run is
    already stopping or failing, whose report says what came first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, lambda signum, frame: None) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def _remove_parents(made: list[Path]) -> None:
    for parent in made:
        try:
            parent.rmdir()
        except FileNotFoundError:
            continue  # not made yet (the failure came first)
        except OSError:
            break  # not empty (another run put something there), or not ours to remove: it, and those above, stay


@dataclass(frozen=True)
class Leftover:
    """A staging folder beside OUT whose run is not running: one killed outright (``kill -9``, the out-of-memory
    killer, a power cut) on this machine, provably gone (``gone``), or one whose owner cannot be checked from here (on
    another host, before a reboot, or an older version's)."""

    path: Path
    pid: int | None
    own: bool  # OUT's own: a run into OUT removes it, if its owner is provably gone
    gone: bool = True
    owner: str = ""  # who made it, where known ("process 12 on host h")

    def note(self, *, removed: bool = False) -> str:
        """One line naming it: removed (by a run into its OUT), or how to remove it."""
        remove = f"rm -rf {shlex.quote(str(self.path))}"
        if not self.gone:
            return (
                f"{self.path}: a conversion's temporary folder, whose owner ({self.owner}) cannot be checked from "
                f"here; if no conversion into it runs there any more, remove it with: {remove}"
            )
        killed = f"left by a conversion that was killed (process {self.pid} is gone)"
        if removed:
            return f"removed {self.path}, {killed}"
        how = f"a conversion into its OUT removes it, or: {remove}" if self.own else f"remove it with: {remove}"
        return f"{self.path}: {killed}; {how}"


def leftovers(output: Path) -> list[Leftover]:
    """The staging folders beside OUT (in its parent folder) whose runs are not running, whichever OUT they were for:
    provably gone, or not known from here (``Leftover``); OUT's own are marked ``own``. A parent that cannot be read
    has none that can be named."""
    own = _beside(output, PARTIAL_SUFFIX, room=PID_ROOM)
    found = []
    try:
        for entry in sorted(output.parent.iterdir()):
            named = _staging_name(entry.name)
            if named is None or not named[0].startswith(".") or not named[0].endswith(PARTIAL_SUFFIX):
                continue
            if entry.is_dir() and not entry.is_symlink() and entry not in _OWNERS:
                judged = ownership.verdict(entry, named[1])
                if not judged.alive:
                    found.append(Leftover(entry, named[1], named[0] == own, judged.gone, judged.owner))
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
    _unowned(temporary)
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
    _unowned(temporary)  # the owner file is the staging folder's, not OUT's
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


def staged_files(temporary: Path, card: str | None = None) -> dict:
    """The files of a finished staging folder by their path in the output (its owner file not among them), and a
    one-file output's ``card`` as README.md: what a push that keeps no local copy commits."""
    files = {
        path.relative_to(temporary).as_posix(): path
        for path in sorted(temporary.rglob("*"))
        if path.is_file() and path.name != ownership.OWNER_FILE
    }
    if card is not None:
        files["README.md"] = card.encode()
    return files


def remove_staging(temporary: Path) -> None:
    """This run's finished staging folder removed (its output went elsewhere: pushed to the Hub as it was made)."""
    _unowned(temporary)
    with _signals_waiting():
        shutil.rmtree(temporary, ignore_errors=True)


def _unowned(temporary: Path) -> None:
    """The owner file of this run's ``temporary`` folder gone, before the folder (or its file) becomes OUT."""
    owner = _OWNERS.get(temporary)
    if owner is not None:
        owner.unlink()


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
