"""How the names a user gives (SOURCE, ADAPTER, OUT, output roots) become paths: ``~`` expanded, as a shell would."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ArgumentError, OutputError


def expanded(name: str | os.PathLike, option: str) -> Path:
    """``name`` as a Path, ``~`` and ``~user`` expanded; ArgumentError (naming ``option``) for a ``~user`` whose user
    does not exist, where Python raises RuntimeError."""
    try:
        return Path(name).expanduser()
    except RuntimeError:
        user = os.fspath(name).split("/", 1)[0]
        raise ArgumentError(f"{os.fspath(name)}: no such user for '{user}'", option=option) from None


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
