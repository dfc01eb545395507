"""Resolve SOURCE (a local folder, a Hub repo id, or a repo in the Hub cache) to a local folder.

Downloads go through ``huggingface_hub.snapshot_download``, which honours HF_ENDPOINT,
HF_HUB_OFFLINE, HF_HOME / HF_HUB_CACHE and HF_TOKEN; only what conversion needs is fetched.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import ArgumentError, Nf4ConvertError, SourceNotFoundError

# What a conversion needs: the weights and their index, configs, tokenizer files, chat templates,
# model cards, licenses and remote code. Not .bin / .pt / .gguf copies of the same weights.
ALLOW_PATTERNS = [
    "*.safetensors", "*.safetensors.index.json", "*.json", "*.py", "*.txt", "*.model", "*.tiktoken",
    "*.jinja", "*.md", "LICENSE*", "NOTICE*", "*.tokenizer", "*spiece*", "*.vocab", "*merges*",
]  # fmt: skip
# Fetched first when the caller checks a repo before its weights (``precheck``): enough to tell a checkpoint that is
# not a bitsandbytes one, or an adapter, without downloading gigabytes.
CONFIG_FILES = ["config.json", "adapter_config.json"]
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
COMMIT = re.compile(r"[0-9a-f]{40}")


def looks_like_repo_id(source: str) -> bool:
    return bool(REPO_ID.match(source)) and not source.startswith((".", "/", "~"))


def model_name(source: str) -> str:
    """The last part of a repo id or folder, for the default output name ("." is the current folder's name)."""
    path = Path(source.rstrip("/") or "/").expanduser()
    if path.name in ("", ".", "..") and path.exists():
        path = path.resolve()
    return path.name or "model"


@contextlib.contextmanager
def progress_bars(enabled: bool) -> Iterator[None]:
    """huggingface_hub's progress bars (downloads, uploads) on as they were, or off for the block and then back as
    they were: the switch is huggingface_hub's own, global to the process. HF_HUB_DISABLE_PROGRESS_BARS=0 keeps
    them on whatever a program asks (huggingface_hub's rule), silently here."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if enabled or are_progress_bars_disabled():
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warning that HF_HUB_DISABLE_PROGRESS_BARS=0 has priority
        disable_progress_bars()
    try:
        yield
    finally:
        if are_progress_bars_disabled():
            enable_progress_bars()


def commit_of(folder: Path) -> str | None:
    """The commit a folder of the Hub cache holds (``.../snapshots/<commit>``), or None for any other folder."""
    return folder.name if folder.parent.name == "snapshots" and COMMIT.fullmatch(folder.name) else None


def resolve(source: str, *, revision: str | None = None, token: str | None = None, cache_dir: str | None = None,
            progress: bool = True, precheck: Callable[[Path], None] | None = None) -> Path:  # fmt: skip
    """A local folder holding the checkpoint named by ``source``.

    ``revision`` (a branch, tag or commit) applies to a Hub repo only. ``progress=False`` hides huggingface_hub's
    download bars. ``precheck``, for a Hub repo, is called on a folder holding only its ``config.json`` and
    ``adapter_config.json`` (those it has) before anything else is downloaded, and may raise to stop there.

    Raises:
        ArgumentError: ``revision`` given with a local folder (which has no revisions).
        SourceNotFoundError: not a folder, and not a Hub repo that can be fetched (or found in the cache offline).

    Example:
        >>> resolve("unsloth/Llama-3.2-1B-Instruct-bnb-4bit")   # downloads only what is needed
        >>> resolve("./my-model-bnb-4bit")                        # a local folder, used in place
    """
    path = Path(source).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ArgumentError(f"{source}: a local folder has no revisions; revision {revision!r} applies to a Hub "
                                "repo id only", option="revision")  # fmt: skip
        return path
    if path.exists():
        raise SourceNotFoundError(f"{source}: is a file, not a checkpoint folder")
    if not looks_like_repo_id(source):
        raise SourceNotFoundError(f"{source}: no such folder (and not a Hub repo id like 'org/name')")

    from huggingface_hub import snapshot_download  # noqa: PLC0415  (keeps CLI start-up fast)
    from huggingface_hub import errors  # noqa: PLC0415

    fetch = dict(revision=revision, token=token, cache_dir=cache_dir)
    try:
        with progress_bars(progress):
            if precheck is not None:
                precheck(Path(snapshot_download(source, allow_patterns=CONFIG_FILES, **fetch)))
            return Path(snapshot_download(source, allow_patterns=ALLOW_PATTERNS, **fetch))
    except errors.GatedRepoError:
        raise SourceNotFoundError(f"{source}: gated repository; accept its terms on the Hub and give a token", option="token") from None
    except errors.RepositoryNotFoundError:
        raise SourceNotFoundError(f"{source}: repository not found on the Hub (private? give a token)", option="token") from None
    except errors.RevisionNotFoundError:
        raise SourceNotFoundError(f"{source}: revision {revision!r} not found", option="revision") from None
    except errors.LocalEntryNotFoundError:
        raise SourceNotFoundError(f"{source}: not in the Hub cache, and the Hub cannot be reached (offline: HF_HUB_OFFLINE is set or there is no network)") from None
    except Nf4ConvertError:  # the precheck's verdict
        raise
    except Exception as error:  # noqa: BLE001  (network, HTTP, xet, file system: one line that keeps the cause)
        from .hub_errors import hub_error_line  # noqa: PLC0415

        raise SourceNotFoundError(f"{source}: cannot be fetched: {hub_error_line(error)}") from None
