"""How the names a user gives (SOURCE, ADAPTER, OUT, output roots) become paths: ``~`` expanded, as a shell would."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ArgumentError


def expanded(name: str | os.PathLike, option: str) -> Path:
    """``name`` as a Path, ``~`` and ``~user`` expanded; ArgumentError (naming ``option``) for a ``~user`` whose user
    does not exist, where Python raises RuntimeError."""
    try:
        return Path(name).expanduser()
    except RuntimeError:
        user = os.fspath(name).split("/", 1)[0]
        raise ArgumentError(f"{os.fspath(name)}: no such user for '{user}'", option=option) from None
