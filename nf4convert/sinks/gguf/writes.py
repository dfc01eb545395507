"""A GGUF's tensor bytes written at their places by a few threads, while the converter's writer goes on.

The converter's writer writes one tensor after another through one buffered file, and a single writing thread moves
fewer bytes a second into the page cache than a GPU or the CPU route makes them. A fast tensor (``gguf_fast.py``)
instead hands its bytes here with their place in the file (where the writer stands, which it then moves past them):
``threads`` threads write them there (``os.pwrite``: the writer's own buffered writes, padding and the tensors the
converter makes itself, go to other places of the same file), each range's writeback started at once as the
safetensors sink does. At most ``limit`` bytes wait; ``finish`` waits for all of them before the file is closed.
"""

from __future__ import annotations

import os
import threading
from collections import deque

from ...safetensors_io.read import as_array
from ...safetensors_io.write import Writeback

WRITE_THREADS = 4
WAITING_BYTES = 256 << 20


class PositionalWrites:
    def __init__(self, descriptor: int, *, threads: int = WRITE_THREADS, limit: int = WAITING_BYTES, writeback=True):
        self._descriptor = descriptor
        self._limit = limit
        self._queue: deque = deque()
        self._waiting = 0  # bytes queued or being written
        self._changed = threading.Condition()
        self._error: BaseException | None = None
        self._stop = False
        self._writeback = Writeback() if writeback else None
        self._flush = self._writeback.open(descriptor) if self._writeback else None
        self._threads = [
            threading.Thread(target=self._run, name="nf4convert-gguf-write", daemon=True) for _ in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def put(self, offset: int, data, prepare=None) -> None:
        """Write ``data`` (a contiguous array or CPU tensor, kept until written) at ``offset``; ``prepare(bytes) ->
        bytes`` (a contiguous array), if given, runs first, on the writing thread (work taken off the caller's), and
        its bytes are written instead."""
        data = as_array(data).reshape(-1).view("uint8")
        with self._changed:
            while not self._stop and self._error is None and self._waiting and self._waiting + data.size > self._limit:
                self._changed.wait()
            self._raise()
            self._queue.append((offset, data, prepare))
            self._waiting += data.size
            self._changed.notify_all()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._stop:
                    self._changed.wait()
                if self._stop:
                    return
                offset, data, prepare = self._queue.popleft()
            try:
                made = prepare(data) if prepare is not None else data
                view, done = memoryview(made).cast("B"), 0
                while done < len(view):
                    done += os.pwrite(self._descriptor, view[done:], offset + done)
                if self._writeback is not None:
                    self._writeback.request(self._flush, offset, len(view))
            except BaseException as error:  # noqa: BLE001  (raised on the writer's thread, at its next put or finish)
                with self._changed:
                    self._error = self._error or error
            with self._changed:
                self._waiting -= data.size
                self._changed.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """Wait until every byte handed over is written; the first write's failure is raised here."""
        with self._changed:
            while self._waiting and self._error is None:
                self._changed.wait()
            self._raise()

    def close(self) -> None:
        """Stop the threads (what was not written yet is dropped: the run failed, or ``finish`` came first)."""
        with self._changed:
            self._stop = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join()
        if self._writeback is not None:
            self._writeback.release(self._flush)
            self._writeback.close()
