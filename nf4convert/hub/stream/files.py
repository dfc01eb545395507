"""The streamed files of one repo at one commit: opened, read by ranges, checked whole, closed."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ...errors import ArgumentError, FetchError, Nf4ConvertError, SourceNotFoundError
from .cached import CachedFile
from .fetching import Fetching
from .metadata import Expected, RemoteFileInfo, describe, expected_of_cached
from .remote import RemoteFile
from .scheduler import Scheduler
from .settings import PAGE_BYTES, StreamSettings, StreamStats

_GAP_BYTES = 1 << 16  # ranges this close together are fetched in one request (read_ranges)
_RUN_BYTES = 1 << 22  # at most this many bytes in such a request


class RemoteFiles(Scheduler, Fetching):
    """The weight files of one repo at one commit, each read through :class:`RemoteFile` (streamed) or
    :class:`CachedFile` (the Hub cache's blob), and checked against the Hub's hash of it. A context manager: leaving
    it stops the fetches (``close``); :meth:`finish` checks every file read, before anything made of them is kept."""

    def __init__(
        self,
        repo_id: str,
        commit: str,
        infos: list[RemoteFileInfo],
        *,
        token: str | bool | None = None,
        endpoint: str | None = None,
        cached: dict[str, tuple[Path, Expected]] | None = None,
        settings: StreamSettings | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ):
        self.repo_id, self.commit, self.token, self.endpoint = repo_id, commit, token, endpoint
        self.settings = settings or StreamSettings()
        if self.settings.block_bytes % PAGE_BYTES or self.settings.block_bytes <= 0:
            raise ArgumentError(f"block_bytes must be a multiple of {PAGE_BYTES}, not {self.settings.block_bytes}")
        self.stats = StreamStats()
        self.on_bytes = on_bytes
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self.closing = threading.Event()
        self._failed: Nf4ConvertError | None = None
        self._finishing = False
        self._held = 0  # bytes of blocks held
        self._spare: list[bytearray] = []  # buffers of blocks let go, for the next ones
        self._hash_fetches = 0
        self._tick = 0  # reads so far, all files: how streams age
        self._transports: dict[str, object] = {}
        self._making = threading.Lock()
        self.files: dict[str, RemoteFile | CachedFile] = {}
        for info in infos:
            self.files[info.name] = RemoteFile(self, info)
        for name, (path, expected) in (cached or {}).items():
            self.files[name] = CachedFile(self, name, path, expected)
        self._workers = [
            threading.Thread(target=self._work, name=f"nf4convert-fetch-{n}", daemon=True)
            for n in range(self.settings.requests_at_once)
        ]
        for worker in self._workers:
            worker.start()

    @classmethod
    def open(
        cls,
        repo_id: str,
        commit: str,
        names: list[str],
        *,
        token: str | bool | None = None,
        endpoint: str | None = None,
        cache: Path | None = None,
        settings: StreamSettings | None = None,
        on_bytes: Callable[[int], None] | None = None,
    ) -> RemoteFiles:
        """``names`` of ``repo_id`` at ``commit`` (a commit id, so that every request reads the same version): each
        read from ``cache`` (a snapshot folder of the Hub cache) where it holds the file, else streamed, its size,
        hash and storage link asked of the Hub (a HEAD at the commit, as huggingface_hub asks before a download).

        Raises:
            SourceNotFoundError: a file the Hub cannot describe (not found, no access, no network, offline), or
                describes without a hash to check its bytes against.
        """
        from huggingface_hub import constants

        cached: dict[str, tuple[Path, Expected]] = {}
        remote = []
        for name in names:
            path = None if cache is None else cache / name
            expected = None if path is None or not path.is_file() else expected_of_cached(path)
            if expected is not None:
                cached[name] = (path, expected)
            else:
                remote.append(name)
        if remote and constants.HF_HUB_OFFLINE:
            raise SourceNotFoundError(
                f"{repo_id}@{commit[:12]}: {remote[0]}: not in the Hub cache, and HF_HUB_OFFLINE is set"
            )
        with ThreadPoolExecutor(8, thread_name_prefix="nf4convert-resolve") as pool:
            infos = list(pool.map(lambda name: describe(repo_id, commit, name, token=token, endpoint=endpoint), remote))
        return cls(
            repo_id, commit, infos, token=token, endpoint=endpoint, cached=cached, settings=settings, on_bytes=on_bytes
        )

    def __getitem__(self, name: str) -> RemoteFile | CachedFile:
        return self.files[name]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    @property
    def streamed_bytes(self) -> int:
        """The size of the files streamed (what a run fetches, at least), beside those read from the cache."""
        return sum(file.size for file in self.files.values() if isinstance(file, RemoteFile))

    def where(self, name: str) -> str:
        return f"{self.repo_id}@{self.commit[:12]}: {name}"

    def read_ranges(self, wanted: list[tuple[str, int, int]]) -> list[bytes]:
        """The bytes ``[first, end)`` of each (file, first, end), fetched ``requests_at_once`` at once, ranges close
        together in one request: what a plan reads (headers, quant states) before the stream begins, checked as any
        read is.

        Raises:
            FetchError, IntegrityError, CheckpointError: as ``pread``.
        """
        runs: list[list] = []  # [name, first, end, [indices of wanted]]
        for index in sorted(range(len(wanted)), key=lambda n: wanted[n]):
            name, first, end = wanted[index]
            if runs and runs[-1][0] == name and first - runs[-1][2] <= _GAP_BYTES and end - runs[-1][1] <= _RUN_BYTES:
                runs[-1][2] = max(runs[-1][2], end)
                runs[-1][3].append(index)
            else:
                runs.append([name, first, end, [index]])

        def fetch(run):
            data = bytearray(run[2] - run[1])
            self.files[run[0]].pread(run[1], data)
            return run, data

        out: list[bytes] = [b""] * len(wanted)
        with ThreadPoolExecutor(self.settings.requests_at_once, thread_name_prefix="nf4convert-ranges") as pool:
            for (name, start, _, indices), data in pool.map(fetch, runs):
                for index in indices:
                    _, first, end = wanted[index]
                    out[index] = bytes(data[first - start : end - start])
        return out

    def fetch_again(self, name: str, first: int, end: int) -> bytes:
        """Bytes ``[first, end)`` of a streamed file fetched anew from the Hub, past every block held: what a plan
        that refused what it read is checked against (were those bytes the Hub's?)."""
        data = bytearray(end - first)
        self._fetch(self.files[name], first, memoryview(data))
        return bytes(data)

    def finish(self) -> None:
        """Wait until every file read so far is checked against its hash (its bytes not read yet fetched for the hash
        alone, with every fetch thread).

        Raises:
            IntegrityError: a file's bytes do not match the Hub's hash of it.
            FetchError: bytes the check needs could not be fetched.
        """
        with self._lock:
            self._finishing = True
            for file in self.files.values():
                if isinstance(file, RemoteFile):
                    file.streams.clear()  # no read follows: what is held is held for the hash alone
                    for block in list(file.blocks.values()):
                        self._settle(file, block)
            self._wake.notify_all()
        for file in self.files.values():
            if isinstance(file, CachedFile) and file.opened:  # a file no read asked for is not the output's
                file.finish()
        with self._lock:
            while True:
                self._raise_failure()
                if all(file.verified or not file.opened for file in self.files.values()):
                    return
                self._wake.wait(0.5)

    def close(self) -> None:
        """Stop every fetch (a fetch under way ends at its next bytes) and let go of what is held."""
        self.closing.set()
        with self._lock:
            self._wake.notify_all()
        for worker in self._workers:
            if worker is not threading.current_thread():
                worker.join(timeout=30)
        for file in self.files.values():
            if isinstance(file, CachedFile):
                file.close()
            else:
                file.blocks.clear()
        for transport in self._transports.values():
            transport.close()

    # -- failures ----------------------------------------------------------------------------------------------------
    def _fail(self, error: Nf4ConvertError) -> None:
        """The first failure ends the run: every read and ``finish`` raises it from now on."""
        with self._lock:
            if self._failed is None:
                self._failed = error
            self._wake.notify_all()

    def _raise_failure(self) -> None:
        failed = self._failed
        if failed is not None:
            raised = type(failed)(str(failed), option=failed.option)
            if isinstance(failed, FetchError):
                raised.tries = failed.tries
            raise raised from None
        if self.closing.is_set():
            raise FetchError(f"{self.repo_id}@{self.commit[:12]}: read after the files were closed")
