"""One file of the repo streamed: its reads, served from blocks or from pages fetched apart."""

from __future__ import annotations

from ...errors import CheckpointError, FetchError, Nf4ConvertError
from .blocks import STALE_READS, Block, Stream
from .hashing import FileHash
from .metadata import RemoteFileInfo
from .settings import DIGEST_BYTES, PAGE_BYTES


class RemoteFile(FileHash):
    """One file of the repo, streamed: ``pread`` reads its bytes (see the package's docstring for how)."""

    def __init__(self, owner, info: RemoteFileInfo):
        self.owner, self.info, self.name, self.size = owner, info, info.name, info.size
        self.location = info.location
        block_bytes = owner.settings.block_bytes
        self.count = -(-info.size // block_bytes)
        self.blocks: dict[int, Block] = {}
        self.streams: list[Stream] = []
        pages = -(-info.size // PAGE_BYTES)
        self._digests = bytearray(pages * DIGEST_BYTES)
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
            # a stream, a large read, or a file of one block (its few small reads would each fetch pages again)
            whole = (
                stream.ahead(block_bytes, owner.settings.ahead_blocks) > 0
                or count >= block_bytes // 2
                or self.size <= block_bytes
            )
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

    def _pin(self, indices: range) -> tuple[list[Block], list[Block]]:
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

    def _continued(self, offset: int, count: int, tick: int) -> Stream:
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
        stream = Stream(offset + count, count, tick)
        self.streams.append(stream)
        if len(self.streams) > self.owner.settings.streams_per_file:
            self.streams.remove(min(self.streams, key=lambda s: s.used))
        return stream

    def live_streams(self, tick: int) -> list[Stream]:
        return [stream for stream in self.streams if tick - stream.used <= STALE_READS]

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
