"""Which block the fetch threads fetch next, within the memory budget, and when a block held is let go."""

from __future__ import annotations

from ...errors import FetchError, Nf4ConvertError
from .blocks import Block
from .remote import RemoteFile


class Scheduler:
    """The fetch threads of :class:`~.files.RemoteFiles` and the blocks they hold (a part of it, on its state)."""

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

    def _new_block(self, file: RemoteFile, index: int) -> Block:
        first = index * self.settings.block_bytes
        buffer = self._spare.pop() if self._spare else bytearray(self.settings.block_bytes)
        block = file.blocks[index] = Block(index, first, min(first + self.settings.block_bytes, file.size), buffer)
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

    def _release(self, file: RemoteFile, block: Block) -> None:
        if file.blocks.get(block.index) is block:
            del file.blocks[block.index]
            self._held -= block.end - block.first
            if block.served and not block.hashed and block.error is None:
                # bytes read from a copy the hash will not see: the copy it sees must bring the same
                file.record_pages(block.first, block.data)
            if (len(self._spare) + 1) * self.settings.block_bytes + self._held <= self.settings.memory_bytes:
                self._spare.append(block.buffer)
            self._wake.notify_all()

    def _settle(self, file: RemoteFile, block: Block) -> None:
        """Let go of a block (under the lock) once nothing needs it: hashed, and read whole or behind every stream."""
        if block.pins or not block.done.is_set():
            return
        if block.error is not None or (
            block.hashed and (block.served >= block.end - block.first or not file.wanted(block.index, self._tick))
        ):
            self._release(file, block)

    def _fetch_block(self, file: RemoteFile, block: Block) -> None:
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
