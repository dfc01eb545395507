"""Writing safetensors shards in place: each header first (the plan fixed every offset), then every piece's bytes at
its offset as soon as they exist, so a whole shard is never held in memory; each range's writeback started at once.

The format (safetensors' docs): an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets relative to the end of
the header), then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import struct
import sys
import threading
from pathlib import Path
from typing import Iterable

from ..errors import InternalError
from .read import as_array

# What every output shard's header says of itself, as torch's save_file writes it (verify checks it).
SHARD_METADATA = {"format": "pt"}


def shard_header(tensors: Iterable) -> bytes:
    """The 8-byte length and JSON header for these tensors (``name``, ``dtype``, ``shape``, ``nbytes``) in this order,
    padded to 8 bytes."""
    header: dict = {"__metadata__": dict(SHARD_METADATA)}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads with spaces so the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class Writeback:
    """Has the disk start on each range as soon as it is written. Linux writes a file's dirty pages back only once
    the page cache holds some gigabytes of them (the dirty threshold) or they are 30 s old, so after a run that
    writes faster than the disk, a ``sync`` waits for nearly all of it; started at the first byte, the disk works
    while the run does. ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` queues a range's writeback and returns (it keeps
    the pages cached; ``posix_fadvise(DONTNEED)`` would start it too but drop them, and a ``--verify`` reads them
    back); it can still wait for the device's queue, so it runs on a thread of its own and no writer waits on the
    disk. Advisory only: where the call is missing (not Linux) or fails, nothing happens, and no error is raised.
    One run owns one, from one thread (``stream.write_shards``); once closed it starts nothing more."""

    SYNC_FILE_RANGE_WRITE = 2

    def __init__(self):
        self._call = _sync_file_range()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = None

    def open(self, descriptor: int) -> int | None:
        """A descriptor of the same file for this thread to use (closed by :meth:`release`), or None when off."""
        if self._call is None or self._stop.is_set():
            return None
        try:
            own = os.dup(descriptor)
        except OSError:  # out of descriptors: no writeback for this file
            return None
        if self._thread is None:
            try:
                thread = threading.Thread(target=self._run, name="nf4convert-writeback", daemon=True)
                thread.start()
            except RuntimeError:  # no thread to be had: no writeback at all
                os.close(own)
                self._call = None
                return None
            self._thread = thread
        return own

    def request(self, descriptor: int | None, position: int, length: int) -> None:
        if descriptor is not None:
            self._requests.put((descriptor, position, length))

    def release(self, descriptor: int | None) -> None:
        """Close ``descriptor`` once the requests before it have run (at once when stopped)."""
        if descriptor is None:
            return
        if self._thread is None:
            os.close(descriptor)
        else:
            self._requests.put((descriptor, None, None))

    def close(self) -> None:
        """Stop without waiting on the disk: the call running ends, the requests still queued are dropped (their
        ranges are written back as the kernel would anyway; a ``sync`` waits for them). Waiting for every request
        instead made a run's exit wait for the disk, seconds after its last write."""
        self._stop.set()
        if self._thread is not None:
            self._requests.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        working = True
        while (request := self._requests.get()) is not None:
            descriptor, position, length = request
            try:
                if position is None:
                    os.close(descriptor)
                elif working and not self._stop.is_set():
                    working = self._call(descriptor, position, length, self.SYNC_FILE_RANGE_WRITE) == 0
            except OSError:  # a close that fails: the descriptor is gone all the same; go on
                pass


def _sync_file_range():
    """libc's ``sync_file_range`` through ctypes (Python's os module has no binding), or None."""

    if not sys.platform.startswith("linux"):
        return None

    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    call.restype = ctypes.c_int
    return call


class ShardWriter:
    """Writes one shard: the header first, then each tensor's bytes, either appended in header order
    (``write(name, data)``) or put at their planned place (``write(name, data, offset=...)``, from any
    number of threads at once: positional writes)."""

    def __init__(self, path: Path, tensors: list, writeback: Writeback | None = None):
        self.path = path
        self.tensors = tensors
        header = shard_header(tensors)
        self._begin: dict[str, int] = {}
        position = len(header)
        for tensor in tensors:
            self._begin[tensor.name] = position
            position += tensor.nbytes
        self._nbytes = {tensor.name: tensor.nbytes for tensor in tensors}
        self._written = dict.fromkeys(self._begin, 0)
        self._lock = threading.Lock()
        self._next = 0  # the tensor appended to next (header order)
        self._writeback = writeback
        self._flush_descriptor = None
        self._descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            self._flush_descriptor = writeback.open(self._descriptor) if writeback is not None else None
            self._pwrite(header, 0)
        except BaseException:  # not yet the caller's to discard
            self.discard()
            raise

    def _pwrite(self, view, position: int) -> None:
        view = memoryview(view)
        while len(view):  # a regular file takes at most ~2 GiB per call
            done = os.pwrite(self._descriptor, view, position)
            if self._writeback is not None:
                self._writeback.request(self._flush_descriptor, position, done)
            view, position = view[done:], position + done

    def write(self, name: str, data, offset: int | None = None) -> None:
        """Bytes (a contiguous numpy array or CPU tensor, any dtype) of tensor ``name``: appended after the bytes it
        has (call in header order), or at byte ``offset`` of the tensor."""
        import numpy as np

        view = memoryview(np.ascontiguousarray(as_array(data))).cast("B")
        if not len(view) and name in self._begin:
            return  # an empty tensor is complete from the start (appending skips past it)
        if offset is None:
            expected = self.tensors[self._next] if self._next < len(self.tensors) else None
            if expected is None or expected.name != name:
                raise InternalError(f"{self.path}: wrote '{name}' where '{expected and expected.name}' comes next")
            offset = self._written[name]
        elif name not in self._begin:
            raise InternalError(f"{self.path}: '{name}' is not planned in this shard")
        planned = self._nbytes[name]
        if offset + len(view) > planned:
            raise InternalError(f"{self.path}: '{name}' got bytes up to {offset + len(view)}, {planned} planned")
        self._pwrite(view, self._begin[name] + offset)
        with self._lock:
            self._written[name] += len(view)
            tensors = self.tensors
            while self._next < len(tensors) and self._written[tensors[self._next].name] >= tensors[self._next].nbytes:
                self._next += 1

    def discard(self) -> None:
        """Close the file, written or not (the run failed; its folder goes). Once only, even if closing fails."""
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is not None:
            try:
                os.close(descriptor)
            finally:
                if self._writeback is not None:
                    self._writeback.release(self._flush_descriptor)

    def close(self) -> None:
        # No fsync: the folder only gets its final name once every shard is closed, so an
        # interrupted run never looks finished; durability across power loss is the OS's.
        unwritten = [t.name for t in self.tensors if self._written[t.name] != t.nbytes]
        self.discard()
        if unwritten:
            raise InternalError(f"{self.path}: closed with {len(unwritten)} tensors unwritten")
