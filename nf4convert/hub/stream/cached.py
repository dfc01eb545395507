"""A file of the Hub cache read in place, and checked by one sequential pass against the hash its blob is named by."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from ...errors import CheckpointError, IntegrityError, Nf4ConvertError
from .metadata import Expected


class CachedFile:
    """A file of the Hub cache, read in place: ``pread`` reads it as a local file is read, and one sequential pass (on
    a thread of its own, from the first read) hashes it; ``finish`` compares that with the hash its blob is named by.
    A cache blob does not change under a run, so the bytes read are the bytes hashed."""

    def __init__(self, owner, name: str, path: Path, expected: Expected):
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
