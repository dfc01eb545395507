"""How sources are named: a Hub repo id, a commit, a model's name and its stem (the name without its quantization
suffix), as default outputs and llama.cpp's converter use them."""

from __future__ import annotations

import re
from pathlib import Path

from ..formats.base import name_suffix
from ..paths import expanded

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT = re.compile(r"[0-9a-f]{40}")


def looks_like_repo_id(source: str) -> bool:
    return bool(REPO_ID.match(source)) and not source.startswith((".", "/", "~"))


def model_name(source: str) -> str:
    """The last part of a repo id or folder, for the default output name ("." is the current folder's name)."""
    path = expanded(source.rstrip("/") or "/", "source")
    if path.name in ("", ".", "..") and path.exists():
        path = path.resolve()
    return path.name or "model"


def commit_of(folder: Path) -> str | None:
    """The commit a folder of the Hub cache holds (``.../snapshots/<commit>``), or None for any other folder."""
    return folder.name if folder.parent.name == "snapshots" and COMMIT.fullmatch(folder.name) else None


def model_stem(source: str) -> str:
    """The model's name, its quantization suffix dropped (org/Llama-bnb-4bit -> Llama): the default output's name, and
    the name llama.cpp's converter is given for a GGUF (by convert and verify alike)."""
    return name_suffix().sub("", model_name(source)) or model_name(source)  # a registered format's suffix
