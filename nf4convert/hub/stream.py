"""A Hub repo's weight files at one commit, read in place of a local copy: positional reads (``pread``) served from
HTTP range requests (or hf_xet's ranged streams), many in flight, never written to disk, every byte checked against
the Hub's hash of its file.

Design. A file is cut into blocks (``StreamSettings.block_bytes``, one request each). Reads are watched as streams:
a read that continues one (the pipeline reads each file roughly front to back, a few files or output shards at once)
makes that stream prefetch the blocks ahead of it, on a pool of fetch threads, within a memory budget shared by the
files; a read that continues none (a header, a quant state, a scale read out of order) fetches just the pages it
covers, in the reading thread. Each range is fetched with its own retries: a dropped connection, a 5xx, a 429 (its
Retry-After honoured), a stalled read (the download timeout) or a short body is asked again from the first byte not yet
received, with backoff; a range that fails as often as ``tries`` allows ends the run in one line (:class:`FetchError`)
saying what failed, after how many tries. A link of the Hub's storage that expires is asked for again at the same
commit, as is every request: a commit pushed while the run reads cannot mix versions. How one range is fetched is
transfer.py's: the storage's signed links with http.client straight into the blocks, through a proxy and for files
the Hub serves itself with huggingface_hub's client, a Xet file with hf_xet's ranged streams.

Integrity. The Hub's hash of a file (its LFS sha256, or for a file kept in git its blob id) is a hash of its bytes in
order, while reads come in any order and some bytes are never read (the header region is read apart, a tensor may be
skipped). So each file keeps one hasher fed with its blocks in file order: a block is hashed when every block before
it has been, and held until then within the budget; bytes no read asked for are fetched for the hash alone (behind
the reads while they run, the rest when the caller finishes). A read is served from the copy the hash sees wherever
it can; where the same bytes are fetched twice, the two copies are compared, so the bytes a read was given are the
bytes the file's hash was computed over:

- bytes read apart before the hash reaches them, or read from a block let go before it was hashed: the sha256 of each
  of their pages (``PAGE_BYTES``) is recorded, and the copy the hash sees must match it;
- a block fetched again after the hash has had it: the hash's state is kept at every block's start, and the block
  must carry it from its start state to its end state.

When the hasher reaches a file's end its digest is compared with the Hub's: a mismatch is an :class:`IntegrityError`
naming the file, and it stops every read. A read is served before its file is verified: the caller places nothing
until :meth:`RemoteFiles.finish` has verified every file read. A file already in the Hub cache is read in place
(:class:`CachedFile`) and checked against the hash its blob is named by, by one sequential pass.

Memory: the blocks held (prefetched, not yet read or not yet hashed) stay within ``memory_bytes``; a read that must
wait for a block fetches it even past the budget (those are bounded by the threads reading), and blocks held only for
the hash are let go first when room is needed (fetched again for the hash later). Nothing is written to disk.

Integration: ``RemoteFiles.open(repo, commit, names, token=..., cache=...)`` resolves each file's size, hash and
storage link with a HEAD at the commit (huggingface_hub's ``get_hf_file_metadata``), and ``files[name].pread(offset,
buffer)`` reads; ``stats`` counts what was streamed and what came from the cache, ``on_bytes`` drives a bar.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import ArgumentError, CheckpointError, FetchError, IntegrityError, Nf4ConvertError, SourceNotFoundError
from .errors import hub_error_line
from .transfer import Closed, Direct, Http, Part, Retry, Xet, direct_reaches

PAGE_BYTES = 1 << 16  # the unit whose digest two reads of the same bytes are compared by
_DIGEST_BYTES = 16  # of a page's sha256: a page fetched again must match this much of the first copy's
_GAP_BYTES = 1 << 16  # ranges this close together are fetched in one request (read_ranges)
_RUN_BYTES = 1 << 22  # at most this many bytes in such a request


@dataclass(frozen=True)
class StreamSettings:
    """How a repo's files are streamed; the defaults suit the Hub from a data-centre link."""

    block_bytes: int = 1 << 23  # one request: large enough that per-request latency is amortized
    memory_bytes: int = 1 << 28  # blocks held at once, all files together
    requests_at_once: int = 8  # fetch threads (reads that must wait for a block fetch it themselves, beside them)
    ahead_blocks: int = 8  # how far a stream prefetches, at most
    streams_per_file: int = 8  # read positions followed in one file (output shards written at once, each its own)
    tries: int = 6  # of one range without a byte received, before the run fails
    # answers in a row that each brought bytes but ended before their length: a server or proxy that cuts every
    # answer short makes progress forever, one slow step at a time, unless this ends it
    short_answers_most: int = 12
    range_seconds_most: float = 600.0  # retrying one range for longer than this fails the run
    wait_first: float = 1.0  # seconds before the second try; doubled for each next one
    wait_most: float = 16.0
    retry_after_most: float = 300.0  # a longer Retry-After fails the run rather than waiting
    timeout: float | None = None  # seconds without a byte before a read is tried again; None: HF_HUB_DOWNLOAD_TIMEOUT
    # "auto": hf_xet for a Xet file where it is installed, else HTTP; "http": HTTP only; "httpx": HTTP through
    # huggingface_hub's client only (as through a proxy); "xet": hf_xet for Xet files
    transport: str = "auto"


@dataclass(frozen=True)
class Expected:
    """The hash a file's bytes must have: an LFS file's sha256 (``X-Linked-Etag``; the Hub cache names its blob by it),
    or for a file kept in git its blob id (the sha1 of ``blob <size>\\0`` and the bytes)."""

    kind: str  # "sha256" or "git-sha1"
    hexdigest: str

    @classmethod
    def of_etag(cls, etag: str | None) -> Expected | None:
        """What an ETag (or a cache blob's name) says the bytes hash to; None for anything else."""
        etag = (etag or "").strip().strip('"').lower()
        if etag.startswith("w/"):  # a weak ETag names no exact bytes
            return None
        if re.fullmatch(r"[0-9a-f]{64}", etag):
            return cls("sha256", etag)
        if re.fullmatch(r"[0-9a-f]{40}", etag):
            return cls("git-sha1", etag)
        return None

    def hasher(self, size: int):
        if self.kind == "sha256":
            return hashlib.sha256()
        hasher = hashlib.sha1()
        hasher.update(b"blob %d\0" % size)
        return hasher

    @property
    def shown(self) -> str:
        return f"{'sha256' if self.kind == 'sha256' else 'git blob id'} {self.hexdigest[:16]}…"


@dataclass(frozen=True)
class RemoteFileInfo:
    """A file of a repo at one commit, as the Hub describes it."""

    name: str
    size: int
    expected: Expected
    url: str  # the file's resolve URL at the commit: where a new storage link is asked for
    location: str  # where its bytes are read: the storage's signed link (a redirect's target), or the URL itself
    xet_hash: str | None = None  # a Xet file's hash, and the route that gives a Xet read token
    xet_refresh: str | None = None


@dataclass
class StreamStats:
    """What a run read: bytes fetched from the Hub (all of them, and those fetched a second time), read from the Hub
    cache, and the requests and retries it took."""

    fetched: int = 0
    fetched_again: int = 0
    cached: int = 0
    requests: int = 0
    retries: int = 0


def expected_of_cached(path: Path) -> Expected | None:
    """The hash a file of a Hub cache snapshot must have, by the blob it links to (named by its sha256 or its git blob
    id); None for a file that is no cache blob."""
    return Expected.of_etag(Path(os.path.realpath(path)).name)


class RemoteFiles:
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

    # -- the fetch threads -------------------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._lock:
                job = None
                while job is None:
                    if self.closing.is_set():
                        return
                    job = None if self._failed is not None else self._pick()
                    if job is None:
                        self._wake.wait()
            file, block, for_hash = job
            try:
                self._fetch_block(file, block)
            finally:
                if for_hash:
                    with self._lock:
                        self._hash_fetches -= 1

    def _pick(self):
        """The next block for a fetch thread (under the lock), None when none may be fetched now:

        1. the block a file's hash is waiting for, if no stream will read it (the reads are past it, or finishing):
           fetched even past the budget, as it lets go of the blocks held behind it;
        2. the block nearest ahead of a stream, room made by letting go of blocks held for the hash alone;
        3. the next blocks a file's hash needs that no stream will read (all of them, once finishing), room made
           only of blocks the hash needs later."""
        block_bytes = self.settings.block_bytes
        limit = self.settings.requests_at_once if self._finishing else max(1, self.settings.requests_at_once // 2)
        hashing = [
            file
            for file in self.files.values()
            if isinstance(file, RemoteFile) and file.opened and not file.verified and file.hash_next < file.count
        ]
        for file in hashing:
            index = file.hash_next
            if self._hash_fetches < limit and index not in file.blocks:
                if self._finishing or file.passed(index, self._tick, block_bytes):
                    self._room(file.block_size(index), beyond=0)
                    self._hash_fetches += 1
                    return file, self._new_block(file, index), True
        nearest = None
        for file in self.files.values():
            if not isinstance(file, RemoteFile) or file.verified:
                continue
            for stream in file.live_streams(self._tick):
                ahead = stream.ahead(block_bytes, self.settings.ahead_blocks)
                base = stream.end // block_bytes
                for index in range(base, min(base + ahead, file.count)):
                    if index not in file.blocks:
                        if nearest is None or index - base < nearest[0]:
                            nearest = (index - base, file, index)
                        break
        if nearest is not None:
            _, file, index = nearest
            if self._room(file.block_size(index), beyond=-1):
                return file, self._new_block(file, index), False
        if self._hash_fetches >= limit:
            return None
        for file in hashing:
            ahead = self.settings.requests_at_once * 2 if self._finishing else 2
            for index in range(file.hash_next + 1, min(file.hash_next + ahead, file.count)):
                if index in file.blocks:
                    continue
                if not self._finishing and not file.passed(index, self._tick, block_bytes):
                    break
                if not self._room(file.block_size(index), beyond=index - file.hash_next):
                    return None
                self._hash_fetches += 1
                return file, self._new_block(file, index), True
        return None

    def _new_block(self, file: RemoteFile, index: int) -> _Block:
        first = index * self.settings.block_bytes
        buffer = self._spare.pop() if self._spare else bytearray(self.settings.block_bytes)
        block = file.blocks[index] = _Block(index, first, min(first + self.settings.block_bytes, file.size), buffer)
        block.hashed = index < file.hash_next  # fetched again for a read: the hash has had these bytes
        self._held += block.end - block.first
        return block

    def _room(self, size: int, beyond: int) -> bool:
        """Make room for ``size`` more bytes held (under the lock) for a block ``beyond`` blocks past its file's hash,
        letting go of blocks held only for their hash that it needs later than that one (the farthest first), and
        only past a block not held yet (those up to it are hashed as soon as it comes); False if there is none."""
        while self._held + size > self.settings.memory_bytes:
            victim = None
            for file in self.files.values():
                if not isinstance(file, RemoteFile):
                    continue
                gap = file.hash_next
                while gap in file.blocks:
                    gap += 1
                for block in file.blocks.values():
                    if block.index < gap or block.pins or not block.done.is_set() or block.hashed:
                        continue
                    if file.wanted(block.index, self._tick):
                        continue
                    distance = block.index - file.hash_next
                    if distance > beyond and (victim is None or distance > victim[0]):
                        victim = (distance, file, block)
            if victim is None:
                return False
            self._release(victim[1], victim[2])
        return True

    def _release(self, file: RemoteFile, block: _Block) -> None:
        if file.blocks.get(block.index) is block:
            del file.blocks[block.index]
            self._held -= block.end - block.first
            if block.served and not block.hashed and block.error is None:
                # bytes read from a copy the hash will not see: the copy it sees must bring the same
                file.record_pages(block.first, block.data)
            if (len(self._spare) + 1) * self.settings.block_bytes + self._held <= self.settings.memory_bytes:
                self._spare.append(block.buffer)
            self._wake.notify_all()

    def _settle(self, file: RemoteFile, block: _Block) -> None:
        """Let go of a block (under the lock) once nothing needs it: hashed, and read whole or behind every stream."""
        if block.pins or not block.done.is_set():
            return
        if block.error is not None or (
            block.hashed and (block.served >= block.end - block.first or not file.wanted(block.index, self._tick))
        ):
            self._release(file, block)

    def _fetch_block(self, file: RemoteFile, block: _Block) -> None:
        """Fetch a block, check its pages, mark it done (its error kept on it if it failed) and hash what can be."""
        try:
            self._raise_failure()
            self._fetch(file, block.first, block.data)
            file.check_block(block)
        except Nf4ConvertError as error:
            block.error = error
            self._fail(error)
        except BaseException as error:  # a stop signal in a reading thread: whoever waits on the block is told
            block.error = FetchError(f"{self.where(file.name)}: stopped ({type(error).__name__})")
            raise
        finally:
            with self._lock:
                block.done.set()
                self._settle(file, block)
                self._wake.notify_all()
        if block.error is None:
            file.advance_hash()

    # -- one range, tried again until it is whole ----------------------------------------------------------------------
    def _fetch(self, file: RemoteFile, first: int, into: memoryview) -> None:
        """``len(into)`` bytes of ``file`` from byte ``first``, retried from the first byte not received yet."""
        part = Part(first, into)
        settings = self.settings
        tries = short = 0
        started = time.monotonic()
        while part.received < len(into):
            before = part.received
            wait = None
            try:
                self._transport(file).attempt(file, part)
                if part.received == len(into):
                    break
                reason = f"the answer ended after {part.received - before} of {len(into) - before} bytes"
            except Retry as retry:
                reason, wait = retry.reason, retry.after
            except Nf4ConvertError:
                raise
            except Closed:
                raise FetchError(f"{self.where(file.name)}: stopped") from None
            except Exception as error:  # noqa: BLE001  (the HTTP client's or hf_xet's: a connection, a timeout)
                reason = hub_error_line(error)
            tries = 1 if part.received > before else tries + 1  # bytes received: the range is making progress
            short = short + 1 if part.received > before else 0
            with self._lock:
                self.stats.retries += 1
            last = part.first + len(into) - 1
            where = f"{self.where(file.name)}: bytes {part.first + part.received}-{last}"
            if tries >= settings.tries:
                raise FetchError(f"{where}: {reason}, after {tries} tries", tries=tries)
            if short >= settings.short_answers_most:
                raise FetchError(
                    f"{where}: the server ends its answers early ({short} answers in a row stopped before the length "
                    "they announced): a proxy or the storage cuts them short",
                    tries=short,
                )
            if time.monotonic() - started > settings.range_seconds_most:
                raise FetchError(
                    f"{where}: {reason}, still not whole after {settings.range_seconds_most:.0f} s of tries",
                    tries=tries,
                )
            if wait is not None and wait > settings.retry_after_most:
                raise FetchError(f"{where}: {reason}, and the Hub asks to wait {wait:.0f} s", tries=tries)
            pause = wait if wait is not None else min(settings.wait_most, settings.wait_first * 2 ** (tries - 1))
            if self.closing.wait(pause):
                raise FetchError(f"{self.where(file.name)}: stopped")

    def _transport(self, file: RemoteFile):
        """hf_xet for a Xet file where it is installed (or asked for); else http.client for a storage link reached
        without a proxy; else huggingface_hub's client."""
        from huggingface_hub import constants

        if file.info.xet_hash and self._use_xet():
            kind = "xet"
        elif self.settings.transport != "httpx" and direct_reaches(file.location, file.info.url, constants.ENDPOINT):
            kind = "direct"
        else:
            kind = "httpx"
        transport = self._transports.get(kind)
        if transport is None:
            with self._making:  # not the main lock: making hf_xet's session takes a while
                transport = self._transports.get(kind)
                if transport is None:
                    transport = self._transports[kind] = {"xet": Xet, "direct": Direct, "httpx": Http}[kind](self)
        return transport

    def _use_xet(self) -> bool:
        if self.settings.transport != "auto":
            return self.settings.transport == "xet"
        from huggingface_hub import constants

        if constants.HF_HUB_DISABLE_XET:
            return False
        try:
            import hf_xet  # noqa: F401
        except ImportError:
            return False
        return True

    def note_request(self) -> None:
        with self._lock:
            self.stats.requests += 1

    def note_received(self, size: int) -> None:
        with self._lock:
            self.stats.fetched += size
        if self.on_bytes is not None:
            self.on_bytes(size)

    def renew_link(self, file: RemoteFile) -> None:
        """Ask the Hub again (at the commit) where the file's bytes are: its storage link expired."""
        info = describe(self.repo_id, self.commit, file.name, token=self.token, endpoint=self.endpoint)
        if info.expected != file.info.expected or info.size != file.size:
            raise IntegrityError(
                f"{self.where(file.name)}: the Hub now describes it as {info.size} bytes of {info.expected.shown}, "
                f"not {file.size} bytes of {file.info.expected.shown}"
            )
        file.location = info.location


def describe(
    repo_id: str, commit: str, name: str, *, token: str | bool | None = None, endpoint: str | None = None
) -> RemoteFileInfo:
    """What the Hub says of file ``name`` at ``commit``: its size, the hash of its bytes, where they are (a HEAD at the
    commit, as huggingface_hub's downloads ask)."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url

    where = f"{repo_id}@{commit[:12]}: {name}"
    url = hf_hub_url(repo_id, name, revision=commit, endpoint=endpoint)
    try:
        try:
            metadata = get_hf_file_metadata(
                url, token=token, timeout=constants.HF_HUB_ETAG_TIMEOUT, endpoint=endpoint, retry_on_errors=True
            )
        except TypeError:  # huggingface_hub before retry_on_errors
            metadata = get_hf_file_metadata(url, token=token, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as error:  # noqa: BLE001  (HTTP, network, offline: one line that keeps the cause)
        raise SourceNotFoundError(f"{where}: cannot be read from the Hub: {hub_error_line(error)}") from None
    if metadata.commit_hash is not None and re.fullmatch(r"[0-9a-f]{40}", commit) and metadata.commit_hash != commit:
        raise SourceNotFoundError(f"{where}: the Hub answered for commit {metadata.commit_hash[:12]}, not this one")
    expected = Expected.of_etag(metadata.etag)
    if expected is None:
        raise SourceNotFoundError(
            f"{where}: the Hub gives no hash of it to check its bytes against (ETag {metadata.etag!r}); "
            "download it instead"
        )
    if metadata.size is None:
        raise SourceNotFoundError(f"{where}: the Hub does not say its size; download it instead")
    xet = metadata.xet_file_data
    return RemoteFileInfo(
        name=name,
        size=int(metadata.size),
        expected=expected,
        url=url,
        location=metadata.location or url,
        xet_hash=None if xet is None else xet.file_hash,
        xet_refresh=None if xet is None else xet.refresh_route,
    )


class _Block:
    """``[first, end)`` of a file, held: fetched (``done``, or its ``error``), hashed, read (``served`` bytes), and
    in use by ``pins`` reads or the hasher."""

    __slots__ = ("index", "first", "end", "buffer", "data", "done", "error", "hashed", "served", "pins")

    def __init__(self, index: int, first: int, end: int, buffer: bytearray):
        self.index, self.first, self.end = index, first, end
        self.buffer = buffer  # a block's size, reused by the blocks after it: the process's memory stays flat
        self.data = memoryview(buffer)[: end - first]
        self.done = threading.Event()
        self.error: Nf4ConvertError | None = None
        self.hashed = False
        self.served = 0
        self.pins = 0


class _Stream:
    """A position reads of a file continue from: the end of the last one, how many continued it and their bytes."""

    __slots__ = ("end", "hits", "read", "largest", "used")

    def __init__(self, end: int, read: int, tick: int):
        self.end, self.hits, self.read, self.largest, self.used = end, 1, read, read, tick

    def ahead(self, block_bytes: int, most: int) -> int:
        """Blocks to prefetch: none for a read or two of small bytes (a header, quant states), then more as it
        proves to be a stream, up to ``most`` blocks or a few of its reads (several threads read one stream)."""
        if self.hits < 2 or self.read < block_bytes // 2:
            return 0
        return min(max(most, -(-_READS_AHEAD * self.largest // block_bytes)), 1 + self.read // block_bytes)


_STALE_READS = 256  # reads (of any file) after which a stream not continued is forgotten
_READS_AHEAD = 4  # a stream prefetches at least this many of its largest reads: the pipeline reads a few at once


class RemoteFile:
    """One file of the repo, streamed: ``pread`` reads its bytes (see the module's docstring for how)."""

    def __init__(self, owner: RemoteFiles, info: RemoteFileInfo):
        self.owner, self.info, self.name, self.size = owner, info, info.name, info.size
        self.location = info.location
        block_bytes = owner.settings.block_bytes
        self.count = -(-info.size // block_bytes)
        self.blocks: dict[int, _Block] = {}
        self.streams: list[_Stream] = []
        pages = -(-info.size // PAGE_BYTES)
        self._digests = bytearray(pages * _DIGEST_BYTES)
        self._known = bytearray(pages)  # the page's digest is recorded: every later copy is compared with it
        self._pending = bytearray(pages)  # reads of the page alone under way: the hash records its digest
        self._seen = bytearray(pages)  # fetched before (what ``fetched_again`` counts)
        self._hasher = info.expected.hasher(info.size)
        self._states = [self._hasher.copy()]  # the hash's state at the start of each block hashed, and after the last
        self.hash_next = 0
        self._hashing = False
        self._busy = -1  # the block being hashed
        self.opened = False
        self.verified = False
        if self.count == 0:
            self._check_digest()

    def block_size(self, index: int) -> int:
        first = index * self.owner.settings.block_bytes
        return min(first + self.owner.settings.block_bytes, self.size) - first

    def pread(self, offset: int, into) -> None:
        """Fill ``into`` (a writable buffer: bytearray, memoryview, uint8 numpy array) with the file's bytes from
        ``offset``. Safe from several threads at once.

        Raises:
            FetchError: the bytes could not be fetched (or an earlier failure stopped the run).
            IntegrityError: a file's bytes did not match the Hub's hash (this file's, or another's before).
            CheckpointError: the range lies past the file's end.
        """
        view = memoryview(into).cast("B")
        count = len(view)
        owner = self.owner
        if offset < 0 or offset + count > self.size:
            raise CheckpointError(
                f"{owner.where(self.name)}: bytes {offset}-{offset + count - 1} lie past its end ({self.size} bytes)"
            )
        block_bytes = owner.settings.block_bytes
        with owner._lock:
            owner._raise_failure()
            self.opened = True
            if count == 0:
                return
            owner._tick += 1
            stream = self._continued(offset, count, owner._tick)
            indices = range(offset // block_bytes, (offset + count - 1) // block_bytes + 1)
            whole = stream.ahead(block_bytes, owner.settings.ahead_blocks) > 0 or count >= block_bytes // 2
            apart = not whole and not all(index in self.blocks for index in indices)
            if not apart:
                blocks, mine = self._pin(indices)
            owner._wake.notify_all()  # a stream moved: the fetch threads may prefetch
        if apart:
            if self._read_pages(offset, view):
                return
            with owner._lock:  # the hash has begun on these pages: read by blocks, checked against its states
                blocks, mine = self._pin(indices)
        try:
            for block in mine:
                owner._fetch_block(self, block)
            for block in blocks:
                while not block.done.wait(0.5):
                    owner._raise_failure()
                if block.error is not None:
                    owner._raise_failure()
                    raise block.error
                first, end = max(offset, block.first), min(offset + count, block.end)
                view[first - offset : end - offset] = block.data[first - block.first : end - block.first]
        finally:
            for block in mine:  # not fetched (a failure or a stop signal came first): nobody may wait for it
                if not block.done.is_set():
                    block.error = block.error or FetchError(f"{owner.where(self.name)}: stopped")
                    block.done.set()
            with owner._lock:
                for block in blocks:
                    block.pins -= 1
                    block.served += min(offset + count, block.end) - max(offset, block.first)
                    owner._settle(self, block)

    def _pin(self, indices: range) -> tuple[list[_Block], list[_Block]]:
        """The blocks a read needs (under the lock), pinned, and those of them this thread must fetch (new ones, held
        past the budget if no room can be made: a read waits for them)."""
        blocks, mine = [], []
        for index in indices:
            block = self.blocks.get(index)
            if block is None:
                self.owner._room(self.block_size(index), beyond=-1)
                block = self.owner._new_block(self, index)
                mine.append(block)
            block.pins += 1
            blocks.append(block)
        return blocks, mine

    def _continued(self, offset: int, count: int, tick: int) -> _Stream:
        """The stream this read continues (under the lock), or a new one in place of the least recently used."""
        block_bytes = self.owner.settings.block_bytes
        for stream in self.streams:
            # a little behind (reads of one stream run on several threads) or a little ahead (a small tensor skipped)
            if stream.end - 2 * block_bytes <= offset <= stream.end + block_bytes:
                stream.hits += 1
                stream.read += count
                stream.largest = max(stream.largest, count)
                stream.end = max(stream.end, offset + count)
                stream.used = tick
                return stream
        stream = _Stream(offset + count, count, tick)
        self.streams.append(stream)
        if len(self.streams) > self.owner.settings.streams_per_file:
            self.streams.remove(min(self.streams, key=lambda s: s.used))
        return stream

    def live_streams(self, tick: int) -> list[_Stream]:
        return [stream for stream in self.streams if tick - stream.used <= _STALE_READS]

    def wanted(self, index: int, tick: int) -> bool:
        """Whether a stream will read block ``index`` soon: it is within the stream's prefetch, or a little behind
        its position and not read whole yet (the reads of one stream run on several threads)."""
        block_bytes = self.owner.settings.block_bytes
        for stream in self.live_streams(tick):
            base = stream.end // block_bytes
            if base <= index < base + max(1, stream.ahead(block_bytes, self.owner.settings.ahead_blocks)):
                return True
            if base - 2 <= index < base:
                block = self.blocks.get(index)
                if block is None or block.served < block.end - block.first:
                    return True
        return False

    def passed(self, index: int, tick: int, block_bytes: int) -> bool:
        """Whether the reads have gone past block ``index`` (behind every stream of the file that reads in earnest),
        so that fetching it for the hash alone takes nothing from them."""
        earnest = [s for s in self.live_streams(tick) if s.read >= 2 * block_bytes]
        return bool(earnest) and all(index < s.end // block_bytes - 2 for s in earnest)

    def _read_pages(self, offset: int, view: memoryview) -> bool:
        """A read that no stream continues: the pages it covers, fetched in this thread (nothing held), their digests
        recorded for the copy the hash sees; False (nothing read) where the hash has begun on them already (the
        caller reads them by blocks, checked against the hash's states)."""
        first = offset // PAGE_BYTES * PAGE_BYTES
        end = min(-(-(offset + len(view)) // PAGE_BYTES) * PAGE_BYTES, self.size)
        numbers = range(first // PAGE_BYTES, -(-end // PAGE_BYTES))
        block_bytes = self.owner.settings.block_bytes
        with self.owner._lock:
            if first // block_bytes < self.hash_next or first // block_bytes <= self._busy:
                return False
            for number in numbers:
                self._pending[number] += 1
        pages = bytearray(end - first)
        try:
            self.owner._fetch(self, first, memoryview(pages))
            self.record_pages(first, pages, lock=True)
            with self.owner._lock:
                self._count_seen(first, end - first)
        except Nf4ConvertError as error:
            self.owner._fail(error)
            raise
        finally:
            with self.owner._lock:
                for number in numbers:
                    self._pending[number] -= 1
        view[:] = memoryview(pages)[offset - first : offset - first + len(view)]
        return True

    def record_pages(self, first: int, data, *, lock: bool = False, only=None) -> None:
        """Compare each page of ``data`` (from page-aligned byte ``first``) with the digest recorded for it, or record
        it (``only``: just those page numbers); IntegrityError if a page came back different. Under the owner's lock
        unless ``lock`` (then it is taken to compare)."""
        view = memoryview(data)
        base = first // PAGE_BYTES
        numbers = range(base, base + -(-len(view) // PAGE_BYTES)) if only is None else only
        digests = {
            number: hashlib.sha256(view[(number - base) * PAGE_BYTES : (number - base + 1) * PAGE_BYTES]).digest()
            for number in numbers
        }
        with self.owner._lock if lock else contextlib.nullcontext():
            for number, digest in digests.items():
                slot = slice(number * _DIGEST_BYTES, (number + 1) * _DIGEST_BYTES)
                if not self._known[number]:
                    self._digests[slot] = digest[:_DIGEST_BYTES]
                    self._known[number] = 1
                elif self._digests[slot] != digest[:_DIGEST_BYTES]:
                    self._differs(number * PAGE_BYTES, min((number + 1) * PAGE_BYTES, self.size))

    def check_block(self, block: _Block) -> None:
        """A block fetched: one the hash has had already (read again) must carry it from its start state to its end
        state; another is compared page by page where a page's digest is recorded (it was read apart before)."""
        with self.owner._lock:
            again = block.hashed
            if again:
                start, end = self._states[block.index].copy(), self._states[block.index + 1]
            known = [n for n in range(block.first // PAGE_BYTES, -(-block.end // PAGE_BYTES)) if self._known[n]]
        if again:
            start.update(block.data)
            if start.digest() != end.copy().digest():
                self._differs(block.first, block.end)
            with self.owner._lock:
                self._count_seen(block.first, block.end - block.first)
            return
        self.record_pages(block.first, block.data, lock=True, only=known)
        with self.owner._lock:
            self._count_seen(block.first, block.end - block.first)

    def _count_seen(self, first: int, size: int) -> None:
        """Count the bytes of pages fetched before (under the lock) and mark these as fetched."""
        again = 0
        for number in range(first // PAGE_BYTES, -(-(first + size) // PAGE_BYTES)):
            if self._seen[number]:
                again += min(PAGE_BYTES, self.size - number * PAGE_BYTES)
            self._seen[number] = 1
        self.owner.stats.fetched_again += again

    def _differs(self, first: int, end: int) -> None:
        raise IntegrityError(
            f"{self.owner.where(self.name)}: bytes {first}-{end - 1} came back different when read again: "
            "corrupted on the way, or not the commit's bytes"
        )

    def advance_hash(self) -> None:
        """Feed the file's hasher every block held from where it stopped, in order (one thread at a time), keeping
        its state at each block's end and recording the digests of pages read apart (or being read apart)."""
        owner = self.owner
        with owner._lock:
            if self._hashing:
                return
            self._hashing = True
        try:
            while True:
                with owner._lock:
                    block = self.blocks.get(self.hash_next)
                    if block is None or not block.done.is_set() or block.error is not None or self.verified:
                        self._hashing = False
                        return
                    block.pins += 1
                    self._busy = block.index
                    pages = range(block.first // PAGE_BYTES, -(-block.end // PAGE_BYTES))
                    apart = [n for n in pages if self._pending[n] or self._known[n]]
                try:
                    self._hasher.update(block.data)
                    if apart:
                        self.record_pages(block.first, block.data, lock=True, only=apart)
                finally:
                    with owner._lock:
                        block.pins -= 1
                with owner._lock:
                    block.hashed = True
                    self._states.append(self._hasher.copy())
                    self.hash_next += 1
                    owner._settle(self, block)
                    owner._wake.notify_all()
                    last = self.hash_next == self.count
                if last:
                    self._check_digest()
                    with owner._lock:
                        self._hashing = False
                    return
        except IntegrityError as error:
            owner._fail(error)
            with owner._lock:
                self._hashing = False

    def _check_digest(self) -> None:
        expected = self.info.expected
        if self._hasher.hexdigest() != expected.hexdigest:
            self.owner._fail(
                IntegrityError(
                    f"{self.owner.where(self.name)}: its bytes do not match the Hub's {expected.shown} (read "
                    f"{self._hasher.hexdigest()[:16]}…): corrupted on the way, or not the commit's bytes"
                )
            )
            return
        with self.owner._lock:
            self.verified = True
            self.owner._wake.notify_all()


class CachedFile:
    """A file of the Hub cache, read in place: ``pread`` reads it as a local file is read, and one sequential pass (on
    a thread of its own, from the first read) hashes it; ``finish`` compares that with the hash its blob is named by.
    A cache blob does not change under a run, so the bytes read are the bytes hashed."""

    def __init__(self, owner: RemoteFiles, name: str, path: Path, expected: Expected):
        self.owner, self.name, self.path, self.expected = owner, name, path, expected
        self._descriptor = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self._descriptor).st_size
        self._started = threading.Lock()
        self._thread: threading.Thread | None = None
        self._error: Nf4ConvertError | None = None
        self.opened = False
        self.verified = False

    def pread(self, offset: int, into) -> None:
        view = memoryview(into).cast("B")
        if offset < 0 or offset + len(view) > self.size:
            raise CheckpointError(
                f"{self.path}: bytes {offset}-{offset + len(view) - 1} lie past its end ({self.size} bytes)"
            )
        self.owner._raise_failure()
        self._start()
        done = 0
        try:
            while done < len(view):
                got = os.preadv(self._descriptor, [view[done:]], offset + done)
                if got == 0:
                    raise CheckpointError(
                        f"{self.path}: truncated while reading bytes {offset}-{offset + len(view) - 1}"
                    )
                done += got
        except OSError as error:
            raise CheckpointError(f"{self.path}: cannot be read ({error.strerror or error})") from None
        with self.owner._lock:
            self.owner.stats.cached += done

    def _start(self) -> None:
        with self._started:
            if self._thread is None:
                self.opened = True
                self._thread = threading.Thread(target=self._hash, name="nf4convert-hash-cached", daemon=True)
                self._thread.start()

    def _hash(self) -> None:
        hasher = self.expected.hasher(self.size)
        chunk = bytearray(1 << 23)
        position = 0
        try:
            while position < self.size and not self.owner.closing.is_set():
                got = os.preadv(self._descriptor, [chunk], position)
                if got == 0:
                    break
                hasher.update(memoryview(chunk)[:got])
                position += got
        except OSError as error:
            self._error = CheckpointError(f"{self.path}: cannot be read ({error.strerror or error})")
            return
        if self.owner.closing.is_set():
            return
        if position != self.size or hasher.hexdigest() != self.expected.hexdigest:
            self._error = self.corrupt()
        else:
            self.verified = True

    def corrupt(self) -> IntegrityError:
        """The error for a cache blob whose bytes do not match the hash it is named by, once the blob (and the
        snapshot's link to it) is removed: the cache must never hold bytes under a name they do not have."""
        blob = Path(os.path.realpath(self.path))
        try:
            blob.unlink()
            if os.path.islink(self.path):
                os.unlink(self.path)
        except OSError as error:
            return IntegrityError(
                f"{self.path}: the Hub cache's copy of {self.name} does not match its {self.expected.shown}: "
                f"corrupted, and it could not be removed ({error.strerror or error}); delete {blob} and run again"
            )
        return IntegrityError(
            f"{self.path}: the Hub cache's copy of {self.name} does not match its {self.expected.shown}: corrupted "
            "(on the way, or on the disk since); removed from the cache: run again to download it anew"
        )

    def check_now(self) -> IntegrityError | None:
        """The file hashed whole, here and now: its error where it does not match (the blob then removed)."""
        self._start()
        self._thread.join()
        return self._error if isinstance(self._error, IntegrityError) else None

    def finish(self) -> None:
        self._start()
        self._thread.join()
        if self._error is not None:
            self.owner._fail(self._error)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=30)
        with contextlib.suppress(OSError):
            os.close(self._descriptor)
