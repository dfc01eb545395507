"""Resolve SOURCE (a local folder, a Hub repo id, or a repo in the Hub cache) to a local folder.

Downloads go through ``huggingface_hub.snapshot_download``, which honours HF_ENDPOINT,
HF_HUB_OFFLINE, HF_HOME / HF_HUB_CACHE and HF_TOKEN; only what conversion needs is fetched.
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import SourceNotFoundError

# What a conversion needs: the weights and their index, configs, tokenizer files, chat templates,
# model cards, licenses and remote code. Not .bin / .pt / .gguf copies of the same weights.
ALLOW_PATTERNS = [
    "*.safetensors", "*.safetensors.index.json", "*.json", "*.py", "*.txt", "*.model", "*.tiktoken",
    "*.jinja", "*.md", "LICENSE*", "NOTICE*", "*.tokenizer", "*spiece*", "*.vocab", "*merges*",
]  # fmt: skip
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(source: str) -> bool:
    return bool(REPO_ID.match(source)) and not source.startswith((".", "/", "~"))


def model_name(source: str) -> str:
    """The last part of a repo id or folder, for the default output name ("." is the current folder's name)."""
    path = Path(source.rstrip("/") or "/").expanduser()
    if path.name in ("", ".", "..") and path.exists():
        path = path.resolve()
    return path.name or "model"


def resolve(source: str, *, revision: str | None = None, token: str | None = None, cache_dir: str | None = None) -> Path:
    """A local folder holding the checkpoint named by ``source``.

    Raises:
        SourceNotFoundError: not a folder, and not a Hub repo that can be fetched (or found in the cache offline).

    Example:
        >>> resolve("unsloth/Llama-3.2-1B-Instruct-bnb-4bit")   # downloads only what is needed
        >>> resolve("./my-model-bnb-4bit")                        # a local folder, used in place
    """
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise SourceNotFoundError(f"{source}: is a file, not a checkpoint folder")
    if not looks_like_repo_id(source):
        raise SourceNotFoundError(f"{source}: no such folder (and not a Hub repo id like 'org/name')")

    from huggingface_hub import snapshot_download  # noqa: PLC0415  (keeps CLI start-up fast)
    from huggingface_hub import errors  # noqa: PLC0415

    try:
        return Path(snapshot_download(source, revision=revision, token=token, cache_dir=cache_dir, allow_patterns=ALLOW_PATTERNS))
    except errors.GatedRepoError:
        raise SourceNotFoundError(f"{source}: gated repository; accept its terms on the Hub and give a token", option="token") from None
    except errors.RepositoryNotFoundError:
        raise SourceNotFoundError(f"{source}: repository not found on the Hub (private? give a token)", option="token") from None
    except errors.RevisionNotFoundError:
        raise SourceNotFoundError(f"{source}: revision {revision!r} not found", option="revision") from None
    except errors.LocalEntryNotFoundError:
        raise SourceNotFoundError(f"{source}: not in the Hub cache, and the Hub cannot be reached (offline: HF_HUB_OFFLINE is set or there is no network)") from None
    except Exception as error:  # noqa: BLE001  (network, HTTP, xet, file system: one line that keeps the cause)
        from .hub_errors import hub_error_line  # noqa: PLC0415

        raise SourceNotFoundError(f"{source}: cannot be fetched: {hub_error_line(error)}") from None
