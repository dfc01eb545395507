"""Resolve SOURCE (a local folder, a Hub repo id, or a repo in the Hub cache) to a local folder.

Downloads go through ``huggingface_hub.snapshot_download``, which honours HF_ENDPOINT,
HF_HUB_OFFLINE, HF_HOME / HF_HUB_CACHE and HF_TOKEN; only what conversion needs is fetched. A plan alone (a dry run)
downloads no weights: ``ranges.py`` reads their headers and quant states by range requests.

huggingface_hub is imported inside the functions that use it: its import takes a good part of a second, which a
local conversion and ``--help`` need not pay.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import ArgumentError, Nf4ConvertError, SourceNotFoundError
from ..files import ADAPTER_WEIGHTS  # an adapter's own weights are small and read whole
from ..options import HubOptions
from ..paths import expanded
from ..safetensors_io.read import read_index
from .errors import hub_error_line
from .names import looks_like_repo_id
from .ranges import HeadersOnly
from .session import hub_session

ALLOW_PATTERNS = [
    "*.safetensors",
    "*.safetensors.index.json",
    "*.json",
    "*.py",
    "*.txt",
    "*.model",
    "*.tiktoken",
    "*.jinja",
    "*.md",
    "LICENSE*",
    "NOTICE*",
    "*.tokenizer",
    "*spiece*",
    "*.vocab",
    "*merges*",
]
# Fetched first when the caller checks a repo before its weights (``precheck``): enough to tell a checkpoint that is
# not one nf4convert reads, or an adapter, without downloading gigabytes.
CONFIG_FILES = ["config.json", "adapter_config.json", "hf_quant_config.json"]


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


def resolve(
    source: str,
    hub: HubOptions = HubOptions(),
    *,
    progress: bool = True,
    precheck: Callable[[Path], None] | None = None,
    headers: HeadersOnly | None = None,
) -> Path:
    """A local folder holding the checkpoint named by ``source``, fetched as ``hub`` says.

    ``hub.revision`` (a branch, tag or commit) applies to a Hub repo only. ``progress=False`` hides huggingface_hub's
    download bars. ``precheck``, for a Hub repo, is called on a folder holding only its ``config.json`` and
    ``adapter_config.json`` (those it has) before anything else is downloaded, and may raise to stop there.
    ``headers``: a Hub repo's weights are not downloaded (unless ``headers.ranged`` is off); the folder returned is its
    copy for a plan, in ``headers.scratch`` (the rest of the repo is downloaded into the Hub cache as usual). Where the
    Hub cache already holds the weights, or offline (HF_HUB_OFFLINE), the Hub cache's folder is returned as without
    ``headers``, and ``headers`` is told of it (hub/weights.py: a streamed conversion's weights, read where they are).

    Raises:
        ArgumentError: ``revision`` given with a local folder (which has no revisions).
        SourceNotFoundError: not a folder, and not a Hub repo that can be fetched (or found in the cache offline).

    Example:
        >>> resolve("unsloth/Llama-3.2-1B-Instruct-bnb-4bit")   # downloads only what is needed
        >>> resolve("./my-model-bnb-4bit")                        # a local folder, used in place
    """
    path, revision, token = expanded(source, "source"), hub.revision, hub.token
    if path.is_dir():
        if revision is not None:
            raise ArgumentError(
                f"{source}: a local folder has no revisions; revision {revision!r} applies to a Hub repo id only",
                option="revision",
            )
        return path
    if path.exists():
        raise SourceNotFoundError(f"{source}: is a file, not a checkpoint folder")
    if not looks_like_repo_id(source):
        raise SourceNotFoundError(f"{source}: no such folder (and not a Hub repo id like 'org/name')")
    owner = Path(source.split("/", 1)[0])
    if not Path(source).is_absolute() and owner.is_dir():  # models/llama beside a models/ folder: a path mistyped
        raise SourceNotFoundError(
            f"{source}: no such folder in {owner}/ (a Hub repo id is not looked up while a folder {owner}/ is here)"
        )

    from huggingface_hub import (
        constants,
        snapshot_download,  # keeps CLI start-up fast
    )
    from huggingface_hub import utils as errors  # in huggingface_hub 0.24 its errors module lacks GatedRepoError

    fetch = dict(revision=revision, token=token, cache_dir=hub.cache_dir)  # snapshot_download's
    try:
        with progress_bars(progress), hub_session(quiet=not progress):
            if precheck is not None:
                precheck(Path(snapshot_download(source, allow_patterns=CONFIG_FILES, **fetch)))
            if headers is not None and headers.ranged and not constants.HF_HUB_OFFLINE:
                rest = Path(snapshot_download(source, allow_patterns=_headers_only_patterns(), **fetch))
                return headers.plan_copy(source, rest, token, _headers_only_patterns())
            folder = Path(snapshot_download(source, allow_patterns=ALLOW_PATTERNS, **fetch))
            if constants.HF_HUB_OFFLINE:
                _check_cached_weights(source, folder)
            if headers is not None:
                headers.downloaded(source, folder, token)
            return folder
    except errors.GatedRepoError:
        raise SourceNotFoundError(
            f"{source}: gated repository; accept its terms on the Hub and give a token", option="token"
        ) from None
    except errors.RepositoryNotFoundError:
        raise SourceNotFoundError(
            f"{source}: repository not found on the Hub (private? give a token)", option="token"
        ) from None
    except errors.RevisionNotFoundError:
        raise SourceNotFoundError(f"{source}: revision {revision!r} not found", option="revision") from None
    except errors.LocalEntryNotFoundError as error:
        raise SourceNotFoundError(f"{source}: not in the Hub cache, and {_not_reached(error)}") from None
    except Nf4ConvertError:  # the precheck's verdict
        raise
    except Exception as error:  # noqa: BLE001  (network, HTTP, xet, file system: one line that keeps the cause)
        raise SourceNotFoundError(f"{source}: cannot be fetched: {hub_error_line(error)}") from None


def _not_reached(error: BaseException) -> str:
    """Why the Hub was not reached for a repo the cache lacks: the offline switch, or the endpoint and its answer
    (a refused connection, an unknown host, an HTTP error), never a guess between the two."""
    from huggingface_hub import constants  # noqa: PLC0415

    from .errors import cause_line  # noqa: PLC0415

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set, so the Hub was not asked"
    cause = cause_line(error)
    return f"the Hub at {constants.ENDPOINT} could not be reached" + (f": {cause}" if cause else "")


def _check_cached_weights(source: str, folder: Path) -> None:
    """Offline, the cache's snapshot must hold the weights its index lists. huggingface_hub 0.24 returns a snapshot
    without them (a dry run's, which fetched everything else) as if complete; the plan would then blame the repo."""

    weight_map = read_index(folder)
    if weight_map is not None and any(not (folder / name).is_file() for name in set(weight_map.values())):
        raise SourceNotFoundError(
            f"{source}: its weights are not in the Hub cache (a dry run reads only their headers), "
            "and HF_HUB_OFFLINE is set"
        )


def _headers_only_patterns() -> list[str]:
    """What a dry run downloads of a repo: everything a conversion would, but its weight files."""

    return [pattern for pattern in ALLOW_PATTERNS if pattern != "*.safetensors"] + [ADAPTER_WEIGHTS]
