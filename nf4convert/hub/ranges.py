"""Byte ranges of a Hub repo's files, read over HTTP without downloading the files: a plan alone (a dry run) reads each
weight file's header and quant states this way. :class:`HeadersOnly` puts each safetensors file of the repo into a
scratch folder as a sparse file that holds the file's header and the tensors a plan reads, read with HTTP range
requests (as ``huggingface_hub``'s ``get_safetensors_metadata`` reads headers), and nothing else.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import Nf4ConvertError, OutputError, SourceNotFoundError
from ..files import ADAPTER_WEIGHTS
from ..formats.base import plan_reads
from ..safetensors_io.read import HEADER_LIMIT, read_header, read_index, series_members
from .names import commit_of

# A headers-only copy holds, of each weight file, its header and the tensors whose bytes a plan reads
# (formats.base.plan_reads: quant states, code tables, nested absmax, 8-bit scales and formats, all small) up to this
# size each; reading any other bytes of it is an error (safetensors_io.read.TensorReader), never zeros.
PLAN_TENSOR_BYTES = 1 << 24
_FIRST_BYTES = (
    100_000  # a file's first request: the whole header for most of the Hub's files (huggingface_hub's figure)
)
_GAP_BYTES = 1 << 16  # such tensors this close together are fetched in one request
_RUN_BYTES = 1 << 24  # at most this many bytes per request
_REQUESTS_AT_ONCE = 8
_FILE_LIMIT = 1 << 44  # 16 TiB: a larger size for a checkpoint file is the endpoint's error


class HeadersOnly:
    """Where ``resolve`` puts Hub repos for a plan alone, without their weights: a temporary folder (made at the first
    copy; ``remove`` deletes it) gets a copy of each repo whose weight files are sparse, holding each file's header and
    the tensors a plan reads. ``ranges`` (file -> the byte ranges it holds) is what a ``checkpoint.TensorReader``
    given it may read; ``copies`` maps each repo id to (its copy, the commit)."""

    what = "a dry run's copy"  # as messages name a copy

    def __init__(self):
        self.scratch: Path | None = None
        self.ranges: dict[Path, list[tuple[int, int]]] = {}
        self.copies: dict[str, tuple[Path, str | None]] = {}

    def new_copy(self, source: str, commit: str | None) -> Path:

        with scratch_errors(source, self.what):
            if self.scratch is None:
                self.scratch = Path(tempfile.mkdtemp(prefix="nf4convert-plan-"))
            folder = self.scratch / str(len(self.copies))
            if commit is not None:  # laid out as the Hub cache lays out a commit: what reads the commit from it does
                folder = folder / "snapshots" / commit
            folder.mkdir(parents=True)
        self.copies[source] = (folder, commit)  # from now on, messages name the repo (conversion.prepare)
        return folder

    def shown(self, folder: Path) -> str | None:
        """How messages name a copy's folder: ``repo@commit``, or None for a folder that is no copy."""
        for source, (copy, commit) in self.copies.items():
            if copy == folder:
                return f"{source}@{commit[:12]}" if commit else source
        return None

    def weight_bytes(self, folder: Path) -> int:
        """The size of the weight files of a copy (what a conversion streams of them)."""
        return sum(os.path.getsize(path) for path in self.ranges if folder in path.parents)

    def remove(self) -> None:

        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def renamed(self, error: Nf4ConvertError) -> Nf4ConvertError | None:
        """``error`` with each copy's folder named as the repo (``repo@commit``), None where it names none."""
        text = str(error)
        for copy, _ in self.copies.values():
            text = text.replace(str(copy), self.shown(copy))
        if text == str(error):
            return None
        renamed = type(error)(text, option=error.option)
        renamed.__dict__.update(error.__dict__)
        return renamed

    # What ``download.resolve`` asks of where it puts a Hub repo (hub/weights.py's HubWeights answers otherwise).
    ranged = True  # the weights are read by ranges, not downloaded (offline, the cache's folder is taken as it is)

    def plan_copy(self, source: str, downloaded: Path, token: str | None, patterns: list[str]) -> Path:
        """The folder a plan reads for a repo whose weights are not downloaded (``downloaded``: the rest of it)."""
        return copy_for_plan(source, downloaded, self, token, patterns)

    def downloaded(self, source: str, folder: Path, token: str | None) -> None:
        """Told of a repo downloaded whole (offline: found in the cache) into ``folder``."""

    def for_adapter(self) -> HeadersOnly | None:
        """Where an ADAPTER repo goes: downloaded whole, as it is small (None), or here."""
        return None


@contextlib.contextmanager
def scratch_errors(source: str, what: str = "a dry run's copy") -> Iterator[None]:
    """A local failure while making a headers-only copy (no temporary folder, no room, read-only): one line that
    names where copies go, not a fetch error (the network's errors are OSErrors too, so only local steps are
    wrapped)."""

    try:
        yield
    except OSError as error:
        where = os.environ.get("TMPDIR") or "the temporary folder"
        raise OutputError(
            f"{where}: cannot hold {what} of {source}'s headers ({error.strerror or error}); "
            "set TMPDIR to a writable folder"
        ) from None


def copy_for_plan(source: str, downloaded: Path, headers: HeadersOnly, token: str | None, patterns: list[str]) -> Path:
    """The repo as a plan reads it: ``downloaded`` (a Hub cache snapshot of everything but the weights) itself where
    it holds the weights already; else a copy in ``headers``: those files copied, and each weight file the plan reads
    (as read_tensors chooses them) at its size, sparse, holding its header and the tensors of formats.base.plan_reads
    (fetched with range requests, several at once)."""

    from huggingface_hub.utils import tqdm as hub_tqdm  # hidden with huggingface_hub's bars

    listed = weight_files(source, downloaded, token)
    if listed is None:
        return downloaded
    names, commit = listed
    folder = headers.new_copy(source, commit)
    copy_files(source, downloaded, folder, patterns)
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


def weight_files(source: str, downloaded: Path, token: str | None) -> tuple[list[str], str | None] | None:
    """The weight files a plan of the repo reads (as read_tensors chooses them: the index's, and its shard series',
    else every ``.safetensors`` file at the top but an adapter's), listed by the Hub at the commit of ``downloaded`` (a
    Hub cache snapshot of everything but the weights), and that commit; None where the cache holds every one of them
    (an earlier conversion's), or there is none (an adapter), or the Hub cannot list them and the cache holds weights
    (then a plan reads the cache, as a conversion would, or says what is missing)."""
    from huggingface_hub import HfApi

    weight_map = read_index(downloaded)
    cached = {p.relative_to(downloaded).as_posix() for p in downloaded.rglob("*.safetensors") if p.is_file()}
    commit = commit_of(downloaded)
    try:
        siblings = [s.rfilename for s in HfApi().model_info(source, revision=commit, token=token).siblings or []]
    except Exception:  # noqa: BLE001  (no network: plan from the cache, as a conversion then would, or say what is missing)
        if cached - {ADAPTER_WEIGHTS}:
            return None
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
        return None
    return names, commit


def copy_files(source: str, downloaded: Path, folder: Path, patterns: list[str]) -> None:
    """Copy into ``folder`` the files of ``downloaded`` that ``patterns`` match (not other tools' files)."""
    with scratch_errors(source):
        for path in sorted(downloaded.rglob("*")):
            relative = path.relative_to(downloaded).as_posix()
            if path.is_file() and any(fnmatch.fnmatch(relative, pattern) for pattern in patterns):
                (folder / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, folder / relative)


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
    with scratch_errors(source):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as file:
            for _, piece in pieces:
                file.write(piece)
            file.truncate(size)
    bar.update(1)
    return name, path, read_header(path)[0], [(at, at + len(piece)) for at, piece in pieces]


def _plan_runs(tensors: dict, held: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges to fetch for a file's tensors that a plan reads (formats.base.plan_reads, at most
    PLAN_TENSOR_BYTES each; a larger one is the plan's to refuse, by its size alone) not held yet, neighbours merged."""
    reads = plan_reads()
    wanted = sorted(
        (t.begin, t.end)
        for t in tensors.values()
        if 0 < t.nbytes <= PLAN_TENSOR_BYTES
        and reads.search(t.name)
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
    with scratch_errors(source):
        descriptor = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(descriptor, data, run[0])
        finally:
            os.close(descriptor)
    bar.update(1)
    return path, run
