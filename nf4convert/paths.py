"""How the names a user gives (SOURCE, ADAPTER, OUT, output roots) become paths: ``~`` expanded, as a shell would, and
a name the file system cannot look at refused in one line naming it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from .errors import ArgumentError, OutputError, SourceNotFoundError

NAME_MAX = 255  # bytes in one file name on Linux's and macOS's file systems
# What looking at a path may meet that says only "not there (yet)": the checks after this one say it in their words.
_NOT_THERE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
_OUTPUTS = ("output", "output_dir")


def expanded(name: str | os.PathLike, option: str) -> Path:
    """``name`` as a Path, ``~`` and ``~user`` expanded; ArgumentError (naming ``option``) for a ``~user`` whose user
    does not exist, where Python raises RuntimeError, and for a name no file system takes (a part longer than
    ``NAME_MAX`` bytes); OutputError (an output) or SourceNotFoundError (a source) for one that cannot be looked at."""
    try:
        path = Path(name).expanduser()
    except RuntimeError:
        user = os.fspath(name).split("/", 1)[0]
        raise ArgumentError(f"{os.fspath(name)}: no such user for '{user}'", option=option) from None
    _looked_at(path, option)
    return path


def _looked_at(path: Path, option: str) -> None:
    """Refuse now what every later look at ``path`` (``exists()``, ``is_dir()``) would raise as an OSError."""
    too_long = next((part for part in path.parts if len(os.fsencode(part)) > NAME_MAX), None)
    if too_long is not None:
        raise ArgumentError(
            f"{path}: a name in it is {len(os.fsencode(too_long))} bytes long; a file system takes at most {NAME_MAX}",
            option=option,
        )
    try:
        os.lstat(path)
    except OSError as error:
        if error.errno in _NOT_THERE:
            return
        if error.errno == errno.ENAMETOOLONG:  # the whole path, past the system's limit
            raise ArgumentError(f"{path}: {error.strerror}", option=option) from None
        refused = OutputError if option in _OUTPUTS else SourceNotFoundError
        raise refused(f"{path}: cannot be looked at ({error.strerror or error})") from None
    except ValueError as error:  # an embedded NUL byte
        raise ArgumentError(f"{os.fspath(path)!r}: {error}", option=option) from None


def expanded_output(name: str | os.PathLike, option: str) -> Path:
    """An output's name (OUT, an output root) as a Path: ``expanded``, and a ``..`` in its parents resolved now, as the
    file system would where the folders exist (symlinks followed) and by the name where they do not, so that no
    folder is made only to be stepped out of (``-o x/../y`` made an empty ``x``)."""
    path = expanded(name, option)
    if ".." in path.parts and path.name != "..":
        try:
            path = path.parent.resolve() / path.name
        except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop (Python < 3.13)
            raise OutputError(f"{os.fspath(name)}: cannot be resolved ({error})") from None
    return path


def as_utf8(text: str) -> str:
    """``text`` (a message, a card) as a UTF-8 file or a terminal can hold it: each byte of a name that is not UTF-8,
    which Python keeps in a ``str`` as a lone surrogate (``os.fsdecode``), written as ``\\xNN``."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file name decodes to
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
