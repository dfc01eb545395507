"""A run's Hub weights, read where they are and checked as they are read.

A Hub repo's weight files are streamed (``stream/``: HTTP ranges or hf_xet's, many in flight, never written to
disk) unless the Hub cache holds them (``--download`` puts them there first, as an earlier download may have): then
they are read from the cache. Either way every byte is checked against the Hub's hash of its file, and every read is
pinned to the commit resolved at the start; :meth:`HubWeights.finish` says whether all of them matched, before an
output made of them is kept. An adapter repo is small: it is downloaded, and its file is checked as it is read.

The plan reads headers from files, as for a local folder: a streamed repo gets a scratch copy (``ranges.HeadersOnly``'s
folder) of its small files and, for each weight file, a sparse file of the weight file's size that holds its header and
the tensors a plan reads (``formats.base.plan_reads``), fetched through the stream (``RemoteFiles.read_ranges``), so
checked as any read is. A ``TensorReader`` given ``ranges`` and ``files`` reads those bytes from the copy and every
other byte through the stream, or the cache's file. The copy holds kilobytes per weight file.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from ..errors import CheckpointError, FetchError, IntegrityError, Nf4ConvertError, SourceNotFoundError
from ..formats.base import plan_reads
from ..safetensors_io.read import HEADER_LIMIT, read_header
from ..settings import Settings
from .names import commit_of
from .ranges import PLAN_TENSOR_BYTES, HeadersOnly, copy_files, scratch_errors, weight_files
from .stream import CachedFile, RemoteFile, RemoteFiles, StreamSettings, StreamStats, expected_of_cached

FIRST_BYTES = 100_000  # a file's first read: the whole header for most of the Hub's files (huggingface_hub's figure)


def stream_settings(settings: Settings) -> StreamSettings:
    """How a run streams, as the NF4CONVERT_* variables ask (``settings.py``)."""
    return StreamSettings(memory_bytes=settings.stream_memory << 20, requests_at_once=settings.stream_requests)


class HubWeights(HeadersOnly):
    """Where ``resolve`` puts the Hub repos of a conversion or a verify (SOURCE, the base an adapter names, ADAPTER):
    each repo's weight files opened at the commit resolved (one ``RemoteFiles`` each), streamed or read from the cache,
    and a scratch copy for the plan of each repo streamed. ``files`` (file -> what reads it) and ``ranges`` (file ->
    the byte ranges its copy holds) are what a ``TensorReader`` is given. A context manager: leaving it stops every
    fetch and removes the copies, and an error that names a copy is raised naming the repo instead."""

    what = "the copy a streamed conversion plans from"

    def __init__(self, *, download: bool = False, settings: Settings | None = None):
        super().__init__()
        self.ranged = not download  # --download: each repo downloaded into the Hub cache, then read there
        self.settings = stream_settings(settings or Settings())
        self.files: dict[Path, RemoteFile | CachedFile] = {}
        self.opened: list[RemoteFiles] = []

    def __enter__(self) -> HubWeights:
        return self

    def __exit__(self, kind, error, trace) -> None:
        try:
            fault = self.read_wrong(error) if isinstance(error, CheckpointError) else None
        finally:
            self.close()
        if fault is not None:
            raise fault from None
        if isinstance(error, Nf4ConvertError):
            renamed = self.renamed(error)
            if renamed is not None:
                raise renamed from None

    def read_wrong(self, error: CheckpointError) -> IntegrityError | None:
        """Whether the files ``error`` names were read as the Hub holds them, asked before the checkpoint is blamed:
        a byte corrupted on the way into a header or a quant state makes the plan refuse the checkpoint before any
        hash is checked. A streamed file's bytes the plan read are fetched again and compared; a cached one is hashed
        whole (and removed from the cache if it does not match). None where what was read is the Hub's."""
        if isinstance(error, (IntegrityError, FetchError)):
            return None
        text = str(error)
        for path, file in self.files.items():
            if str(path) not in text and file.name not in text:
                continue
            try:
                if isinstance(file, CachedFile):
                    fault = file.check_now()
                    if fault is not None:
                        return fault
                    continue
                for begin, end in self.ranges.get(path, []):
                    with open(path, "rb") as copy:
                        copy.seek(begin)
                        held = copy.read(end - begin)
                    if held != file.owner.fetch_again(file.name, begin, end):
                        return IntegrityError(
                            f"{file.owner.where(file.name)}: bytes {begin}-{end - 1}, which the plan read, differ "
                            "when fetched again: corrupted on the way (the checkpoint was not at fault); run again"
                        )
            except (OSError, Nf4ConvertError):  # the check itself failed: the plan's error stands
                continue
        return None

    # -- what download.resolve asks ------------------------------------------------------------------------------------
    def for_adapter(self) -> HubWeights:
        return self

    def plan_copy(self, source: str, downloaded: Path, token: str | None, patterns: list[str]) -> Path:
        """The folder a plan of ``source`` reads: ``downloaded`` (everything but the weights, in the Hub cache) itself
        where the cache holds every weight file, else a scratch copy; each weight file opened to be read where it is."""
        listed = weight_files(source, downloaded, token)
        if listed is None:  # all in the cache (or none: an adapter)
            self.downloaded(source, downloaded, token)
            return downloaded
        names, commit = listed
        if commit is None:
            raise SourceNotFoundError(f"{source}: the Hub cache's folder {downloaded} names no commit to read it at")
        remote = self._open(source, commit, names, token, downloaded)
        if not any(isinstance(remote[name], RemoteFile) for name in names):
            for name in names:
                self.files[downloaded / name] = remote[name]
            return downloaded
        folder = self.new_copy(source, commit)
        copy_files(source, downloaded, folder, patterns)
        for name in names:
            self.files[folder / name] = remote[name]
        self._fill(source, remote, names, folder)
        return folder

    def downloaded(self, source: str, folder: Path, token: str | None) -> None:
        """A repo downloaded whole, or found whole in the Hub cache: its weight files read there, checked against the
        hash their cache blobs are named by."""
        names = _cached_files(folder)
        commit = commit_of(folder)
        if names and commit is not None:
            remote = self._open(source, commit, names, token, folder)
            for name in names:
                self.files[folder / name] = remote[name]

    # -- the run's end -------------------------------------------------------------------------------------------------
    @property
    def streams(self) -> bool:
        """Whether a weight file is read over the network (its reads are then fastest front to back)."""
        return any(isinstance(file, RemoteFile) for file in self.files.values())

    @property
    def streamed_bytes(self) -> int:
        """The size of the weight files streamed (at least what a run fetches), all repos together."""
        return sum(remote.streamed_bytes for remote in self.opened)

    @property
    def stats(self) -> StreamStats:
        """What the run read, all repos together: fetched (and fetched twice), from the cache, retries."""
        total = StreamStats()
        for remote in self.opened:
            for key, value in vars(remote.stats).items():
                setattr(total, key, getattr(total, key) + value)
        return total

    def finish(self) -> None:
        """Wait until every file read is checked against the Hub's hash of it (the bytes no read asked for fetched for
        the hash alone): an output may be kept only after this.

        Raises:
            IntegrityError: a file's bytes do not match the Hub's hash of it (or two reads of them differed).
            FetchError: bytes the check needs could not be fetched.
        """
        for remote in self.opened:
            remote.finish()

    def close(self) -> None:
        """Stop every fetch, let go of what is held, remove the copies."""
        try:
            for remote in self.opened:
                remote.close()
        finally:
            self.remove()

    # -- within -----------------------------------------------------------------------------------------------------
    def _open(self, source: str, commit: str, names: list[str], token: str | None, cache: Path) -> RemoteFiles:
        remote = RemoteFiles.open(source, commit, names, token=token, cache=cache, settings=self.settings)
        self.opened.append(remote)
        return remote

    def _fill(self, source: str, remote: RemoteFiles, names: list[str], folder: Path) -> None:
        """Write each weight file into ``folder`` at its size, sparse, holding its header and the tensors a plan reads
        (as ``ranges.copy_for_plan`` does, read through ``remote``: its first bytes, the rest of its header, then those
        tensors, each step's reads all at once)."""
        sizes = {name: remote[name].size for name in names}
        first = [(name, 0, min(FIRST_BYTES, sizes[name])) for name in names]
        held: dict[str, list[tuple[int, int, bytes]]] = {
            name: [(0, len(data), data)] for name, data in zip(names, remote.read_ranges(first))
        }
        rest = []
        for name in names:
            data = held[name][0][2]
            if len(data) >= 8:
                (length,) = struct.unpack("<Q", data[:8])
                if len(data) < 8 + length <= min(sizes[name], 8 + HEADER_LIMIT):  # else read_header names the problem
                    rest.append((name, len(data), 8 + length))
                elif 8 + length < len(data):  # the copy holds the header, not the tensor bytes read with it
                    held[name] = [(0, 8 + length, data[: 8 + length])]
        for (name, begin, end), data in zip(rest, remote.read_ranges(rest)):
            held[name].append((begin, end, data))
        reads = plan_reads()
        wanted = []
        with scratch_errors(source, self.what):
            for name in names:
                path = folder / name
                path.parent.mkdir(parents=True, exist_ok=True)
                _write(path, sizes[name], held[name])
                spans = [(begin, end) for begin, end, _ in held[name]]
                self.ranges[path] = spans  # what the copy holds so far (read_wrong checks these if the header fails)
                for info in read_header(path)[0].values():
                    if 0 < info.nbytes <= PLAN_TENSOR_BYTES and reads.search(info.name):
                        if not any(a <= info.begin and info.end <= b for a, b in spans):
                            wanted.append((name, info.begin, info.end))
        fetched = remote.read_ranges(wanted)
        with scratch_errors(source, self.what):
            for (name, begin, end), data in zip(wanted, fetched):
                _write(folder / name, sizes[name], [(begin, end, data)])
                held[name].append((begin, end, data))
        for name in names:
            self.ranges[folder / name] = [(begin, end) for begin, end, _ in held[name]]


def _cached_files(folder: Path) -> list[str]:
    """The ``.safetensors`` files of a Hub cache snapshot (relative names) held as blobs named by their hash."""
    return sorted(
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*.safetensors")
        if path.is_file() and expected_of_cached(path) is not None
    )


def _write(path: Path, size: int, pieces: list[tuple[int, int, bytes]]) -> None:
    """``pieces`` (first byte, end, bytes) written into ``path`` at their places, the file made ``size`` bytes long
    (the rest a hole)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for begin, _, data in pieces:
            os.pwrite(descriptor, data, begin)
        os.ftruncate(descriptor, size)
    finally:
        os.close(descriptor)
