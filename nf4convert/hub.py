"""Resolve SOURCE (a local folder, a Hub repo id, or a repo in the Hub cache) to a local folder.

Downloads go through ``huggingface_hub.snapshot_download``, which honours HF_ENDPOINT,
HF_HUB_OFFLINE, HF_HOME / HF_HUB_CACHE and HF_TOKEN; only what conversion needs is fetched.

A plan alone (a dry run) downloads no weights: :class:`HeadersOnly` puts each safetensors file of the repo into a
scratch folder as a sparse file that holds the file's header and its quant states, read with HTTP range requests
(as ``huggingface_hub``'s ``get_safetensors_metadata`` reads headers), and nothing else.

huggingface_hub is imported inside the functions that use it: its import takes a good part of a second, which a
local conversion and ``--help`` need not pay.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import shutil
import struct
import tempfile
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .errors import ArgumentError, Nf4ConvertError, OutputError, SourceNotFoundError
from .files import ADAPTER_WEIGHTS  # an adapter's own weights are small and read whole
from .formats import PLAN_READS
from .hub_errors import hub_error_line
from .paths import expanded
from .safetensors_io.read import HEADER_LIMIT, read_header, read_index, series_members

# What a conversion needs: the weights and their index, configs, tokenizer files, chat templates,
# model cards, licenses and remote code. Not .bin / .pt / .gguf copies of the same weights.
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
# not a bitsandbytes one, or an adapter, without downloading gigabytes.
CONFIG_FILES = ["config.json", "adapter_config.json"]
# A headers-only copy holds, of each weight file, its header and the tensors whose bytes a plan reads
# (formats.PLAN_READS: quant states, code tables, nested absmax, 8-bit scales and formats, all small) up to this size
# each; reading any other bytes of it is an error (safetensors_io.read.TensorReader), never zeros.
PLAN_TENSOR_BYTES = 1 << 24
_FIRST_BYTES = 100_000  # a file's first request: the whole header for 97% of the Hub's files (huggingface_hub's figure)
_GAP_BYTES = 1 << 16  # such tensors this close together are fetched in one request
_RUN_BYTES = 1 << 24  # at most this many bytes per request
_REQUESTS_AT_ONCE = 8
_FILE_LIMIT = 1 << 44  # 16 TiB: a larger size for a checkpoint file is the endpoint's error
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


class HeadersOnly:
    """Where ``resolve`` puts Hub repos for a plan alone, without their weights: a temporary folder (made at the first
    copy; ``remove`` deletes it) gets a copy of each repo whose weight files are sparse, holding each file's header and
    the tensors a plan reads. ``ranges`` (file -> the byte ranges it holds) is what a ``checkpoint.TensorReader``
    given it may read; ``copies`` maps each repo id to (its copy, the commit)."""

    def __init__(self):
        self.scratch: Path | None = None
        self.ranges: dict[Path, list[tuple[int, int]]] = {}
        self.copies: dict[str, tuple[Path, str | None]] = {}

    def new_copy(self, source: str, commit: str | None) -> Path:

        with _scratch_errors(source):
            if self.scratch is None:
                self.scratch = Path(tempfile.mkdtemp(prefix="nf4convert-plan-"))
            folder = self.scratch / str(len(self.copies))
            folder.mkdir()
        self.copies[source] = (folder, commit)  # from now on, messages name the repo (conversion.prepare)
        return folder

    def shown(self, folder: Path) -> str | None:
        """How messages name a copy's folder: ``repo@commit``, or None for a folder that is no copy."""
        for source, (copy, commit) in self.copies.items():
            if copy == folder:
                return f"{source}@{commit[:12]}" if commit else source
        return None

    def remove(self) -> None:

        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


@contextlib.contextmanager
def _scratch_errors(source: str) -> Iterator[None]:
    """A local failure while making a headers-only copy (no temporary folder, no room, read-only): one line that
    names where copies go, not a fetch error (the network's errors are OSErrors too, so only local steps are
    wrapped)."""

    try:
        yield
    except OSError as error:
        where = os.environ.get("TMPDIR") or "the temporary folder"
        raise OutputError(
            f"{where}: cannot hold a dry run's copy of {source}'s headers ({error.strerror or error}); "
            "set TMPDIR to a writable folder"
        ) from None


def resolve(
    source: str,
    *,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | None = None,
    progress: bool = True,
    precheck: Callable[[Path], None] | None = None,
    headers: HeadersOnly | None = None,
) -> Path:
    """A local folder holding the checkpoint named by ``source``.

    ``revision`` (a branch, tag or commit) applies to a Hub repo only. ``progress=False`` hides huggingface_hub's
    download bars. ``precheck``, for a Hub repo, is called on a folder holding only its ``config.json`` and
    ``adapter_config.json`` (those it has) before anything else is downloaded, and may raise to stop there.
    ``headers``: a Hub repo's weights are not downloaded; the folder returned is its copy for a plan, in
    ``headers.scratch`` (the rest of the repo is downloaded into the Hub cache as usual). Where the Hub cache already
    holds the weights, or offline (HF_HUB_OFFLINE), the Hub cache's folder is returned as without ``headers``.

    Raises:
        ArgumentError: ``revision`` given with a local folder (which has no revisions).
        SourceNotFoundError: not a folder, and not a Hub repo that can be fetched (or found in the cache offline).

    Example:
        >>> resolve("unsloth/Llama-3.2-1B-Instruct-bnb-4bit")   # downloads only what is needed
        >>> resolve("./my-model-bnb-4bit")                        # a local folder, used in place
    """
    path = expanded(source, "source")
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

    from huggingface_hub import (
        constants,
        snapshot_download,  # keeps CLI start-up fast
    )
    from huggingface_hub import utils as errors  # in huggingface_hub 0.24 its errors module lacks GatedRepoError

    fetch = dict(revision=revision, token=token, cache_dir=cache_dir)
    try:
        with progress_bars(progress):
            if precheck is not None:
                precheck(Path(snapshot_download(source, allow_patterns=CONFIG_FILES, **fetch)))
            if headers is not None and not constants.HF_HUB_OFFLINE:
                rest = Path(snapshot_download(source, allow_patterns=_headers_only_patterns(), **fetch))
                return _copy_for_plan(source, rest, headers, token)
            folder = Path(snapshot_download(source, allow_patterns=ALLOW_PATTERNS, **fetch))
            if constants.HF_HUB_OFFLINE:
                _check_cached_weights(source, folder)
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

    from .hub_errors import cause_line  # noqa: PLC0415

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

    return [pattern for pattern in ALLOW_PATTERNS if pattern != "*.safetensors"] + [ADAPTER_WEIGHTS]


def _copy_for_plan(source: str, downloaded: Path, headers: HeadersOnly, token: str | None) -> Path:
    """The repo as a plan reads it: ``downloaded`` (a Hub cache snapshot of everything but the weights) itself where
    it holds the weights already; else a copy in ``headers``: those files copied, and each weight file the plan reads
    (as read_tensors chooses them) at its size, sparse, holding its header and the tensors of formats.PLAN_READS
    (fetched with range requests, several at once)."""

    from huggingface_hub import HfApi
    from huggingface_hub.utils import tqdm as hub_tqdm  # hidden with huggingface_hub's bars

    weight_map = read_index(downloaded)
    cached = {p.relative_to(downloaded).as_posix() for p in downloaded.rglob("*.safetensors") if p.is_file()}
    commit = commit_of(downloaded)
    try:
        siblings = [s.rfilename for s in HfApi().model_info(source, revision=commit, token=token).siblings or []]
    except Exception:  # noqa: BLE001  (no network: plan from the cache, as a conversion then would, or say what is missing)
        if cached - {ADAPTER_WEIGHTS}:
            return downloaded
        raise
    if weight_map is not None:
        listed = set(weight_map.values())
        names = sorted(
            (listed & set(siblings)) | series_members(listed, siblings)
        )  # one listed but missing: the plan says so
    else:
        names = sorted(
            name for name in siblings if "/" not in name and name.endswith(".safetensors") and name != ADAPTER_WEIGHTS
        )
    if set(names) <= cached:
        # every file the plan reads is in the cache (an earlier conversion's), or there is none (an adapter)
        return downloaded

    folder = headers.new_copy(source, commit)
    patterns = _headers_only_patterns()
    with _scratch_errors(source):
        for path in sorted(downloaded.rglob("*")):
            relative = path.relative_to(downloaded).as_posix()
            if path.is_file() and any(
                fnmatch.fnmatch(relative, pattern) for pattern in patterns
            ):  # not other tools' files
                (folder / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, folder / relative)
    reader = _RangeReader(source, commit, token)
    with ThreadPoolExecutor(_REQUESTS_AT_ONCE, thread_name_prefix="nf4convert-headers") as pool:
        with hub_tqdm(total=len(names), desc="Reading headers", unit="file") as bar:
            files = list(pool.map(lambda name: _sparse_file(reader, source, name, folder / name, bar), names))
        runs = [(name, path, run) for name, path, tensors, held in files for run in _plan_runs(tensors, held)]
        with hub_tqdm(total=len(runs), desc="Reading quant states", unit="range") as bar:
            fetched = list(pool.map(lambda item: _fill(reader, source, *item, bar), runs))
    for _, path, _, held in files:
        headers.ranges[path] = held
    for path, run in fetched:
        headers.ranges[path].append(run)
    return folder


class _RangeReader:
    """Byte ranges of a repo's files at one commit, as huggingface_hub's ``get_safetensors_metadata`` reads them (with
    its retries). An answer that is not the range asked for (a whole file, a wrong range) is refused before its body
    is read."""

    def __init__(self, source: str, commit: str | None, token: str | None):
        from huggingface_hub import constants, hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        self.source, self.commit, self.url = source, commit, hf_hub_url
        self.headers = build_hf_headers(token=token)
        self.timeout = getattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 10)

    def read(self, name: str, first: int, end: int) -> tuple[bytes, int]:
        """Bytes ``[first, end)`` of file ``name`` (fewer where the file ends first) and the file's size. The answer's
        status and headers are checked before its body is read: a whole file is never taken in by mistake."""
        from huggingface_hub.utils import hf_raise_for_status

        url = self.url(self.source, name, revision=self.commit)
        where = f"{self.source}: {name}: the Hub answered a request for bytes {first}-{end - 1}"
        with _streamed(url, {**self.headers, "Range": f"bytes={first}-{end - 1}"}, self.timeout) as (response, body):
            content_range = (response.headers.get("Content-Range") or "").strip()
            if (
                response.status_code == 416 and first == 0 and content_range == "bytes */0"
            ):  # an empty file has no byte 0
                return b"", 0
            if response.status_code >= 400:
                body()  # for the error's message
                hf_raise_for_status(response)
            if response.status_code != 206:
                length = response.headers.get("Content-Length")
                if first != 0 or length is None or not length.isdigit() or int(length) > end - first:
                    raise SourceNotFoundError(
                        f"{where} with status {response.status_code} and not the range (the whole "
                        "file?): a dry run needs range requests; convert instead (that downloads "
                        "the weights)"
                    )
                data = body()
                return data, len(data)  # a file no larger than the range, whole
            match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", content_range)
            if match is None or int(match[1]) != first or int(match[2]) >= end or int(match[3]) > _FILE_LIMIT:
                got = f"Content-Range {content_range!r}" if content_range else "no Content-Range"
                raise SourceNotFoundError(f"{where} with {got}")
            data = body()
        if len(data) != int(match[2]) - first + 1:
            raise SourceNotFoundError(f"{where} with {len(data)} bytes for {content_range!r}")
        return data, int(match[3])


@contextlib.contextmanager
def _streamed(url: str, headers: dict, timeout) -> Iterator[tuple]:
    """(response, read its body) for a GET whose body is not read yet, with huggingface_hub's retries: its
    ``http_stream_backoff`` (huggingface_hub 1.0 and later, httpx), or ``http_backoff`` with requests' ``stream``."""
    from huggingface_hub import utils

    if hasattr(utils, "http_stream_backoff"):
        with utils.http_stream_backoff("GET", url, headers=headers, timeout=timeout) as response:
            yield response, response.read
    else:
        response = utils.http_backoff("GET", url, headers=headers, timeout=timeout, stream=True)
        try:
            yield response, lambda: response.content
        finally:
            response.close()


def _sparse_file(reader: _RangeReader, source: str, name: str, path: Path, bar) -> tuple[str, Path, dict, list]:
    """Write ``path`` at the size of the repo's file ``name``, holding its first bytes and whole header; read that
    header as any checkpoint's is read (checkpoint.read_header). (name, path, its tensors, the byte ranges held)."""

    data, size = reader.read(name, 0, _FIRST_BYTES)
    pieces = [(0, data)]
    if len(data) >= 8:
        (length,) = struct.unpack("<Q", data[:8])
        if len(data) < 8 + length <= min(size, 8 + HEADER_LIMIT):  # else read_header names the problem
            pieces.append((len(data), reader.read(name, len(data), 8 + length)[0]))
    with _scratch_errors(source):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as file:
            for _, piece in pieces:
                file.write(piece)
            file.truncate(size)
    bar.update(1)
    return name, path, read_header(path)[0], [(at, at + len(piece)) for at, piece in pieces]


def _plan_runs(tensors: dict, held: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges to fetch for a file's tensors that a plan reads (formats.PLAN_READS, at most PLAN_TENSOR_BYTES
    each; a larger one is the plan's to refuse, by its size alone) not held yet, neighbours merged."""

    wanted = sorted(
        (t.begin, t.end)
        for t in tensors.values()
        if 0 < t.nbytes <= PLAN_TENSOR_BYTES
        and PLAN_READS.search(t.name)
        and not any(a <= t.begin and t.end <= b for a, b in held)
    )
    runs: list[list[int]] = []
    for begin, end in wanted:
        if runs and begin - runs[-1][1] <= _GAP_BYTES and end - runs[-1][0] <= _RUN_BYTES:
            runs[-1][1] = end
        else:
            runs.append([begin, end])
    return [(begin, end) for begin, end in runs]


def _fill(
    reader: _RangeReader, source: str, name: str, path: Path, run: tuple[int, int], bar
) -> tuple[Path, tuple[int, int]]:

    data, _ = reader.read(name, *run)
    if len(data) != run[1] - run[0]:
        raise SourceNotFoundError(f"{source}: {name}: bytes {run[0]}-{run[1] - 1} came back short ({len(data)} bytes)")
    with _scratch_errors(source):
        descriptor = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(descriptor, data, run[0])
        finally:
            os.close(descriptor)
    bar.update(1)
    return path, run
