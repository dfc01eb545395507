"""A streamed file's bytes checked: one hasher fed in file order, and every copy read compared with the one hashed."""

from __future__ import annotations

import contextlib
import hashlib

from ...errors import IntegrityError
from .blocks import Block
from .settings import DIGEST_BYTES, PAGE_BYTES


class FileHash:
    """The hash side of :class:`~.remote.RemoteFile` (a part of it, on its state)."""

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
                slot = slice(number * DIGEST_BYTES, (number + 1) * DIGEST_BYTES)
                if not self._known[number]:
                    self._digests[slot] = digest[:DIGEST_BYTES]
                    self._known[number] = 1
                elif self._digests[slot] != digest[:DIGEST_BYTES]:
                    self._differs(number * PAGE_BYTES, min((number + 1) * PAGE_BYTES, self.size))

    def check_block(self, block: Block) -> None:
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
