"""The piece pipeline: pieces through read -> make -> write, each stage on its own threads, so reading, making and
writing overlap; one pipeline serves every route and every sink.

    read   positional reads of the source bytes into a reused host buffer        (reader threads)
    make   the output bytes from them: a cast on the CPU, or a dequantization     (the route's makers)
    write  the sink's write of the piece at its planned offset                    (writer threads)

Memory is bounded by the pieces in flight (``READ_AHEAD + makers + WRITE_AHEAD``, each at most ``piece_bytes`` in and
out), whatever the model; buffers are reused (the route's pools).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from .. import profile
from ..safetensors_io.read import TensorReader, as_array
from .piece import Piece, read_piece

READ_AHEAD = 3  # pieces read before their make begins
WRITE_AHEAD = 3  # pieces made and waiting for (or being written by) the writers; more than one write in flight


class Pipeline:
    """Pieces through read -> make -> write, in order of arrival, at most ``READ_AHEAD + makers + WRITE_AHEAD``
    in flight. The caller's thread moves each piece on when the stage before it is done, so a failure in any
    stage surfaces there (and stops everything) at the next step."""

    def __init__(self, route, reader: TensorReader, progress: Callable[[int], None], *, writers: int):
        """``writers``: threads writing at once (one per shard written at once serves best)."""

        self.route, self.reader, self.progress = route, reader, progress
        self._readers = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="nf4convert-read")
        self._makers = ThreadPoolExecutor(
            route.makers, thread_name_prefix="nf4convert-make", initializer=route.maker_started
        )
        self._writers = ThreadPoolExecutor(writers, thread_name_prefix="nf4convert-write")
        self._reads: deque = deque()
        self._makes: deque = deque()
        self._writes: deque = deque()
        self._busy = dict.fromkeys(("read", "make", "write"), 0.0)
        self._waited = dict.fromkeys(("read", "make", "write"), 0.0)
        self._pieces = 0
        self._started = _now()
        self.infinite: set[str] = set()  # watched tensors written with ±inf (set.add under the GIL: one at a time)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def close(self) -> None:
        for pool in (self._readers, self._makers, self._writers):
            pool.shutdown(wait=True, cancel_futures=True)  # nothing runs on after a failure
        if self._started is not None:
            profile.record(
                pipeline={
                    "seconds": _now() - self._started,
                    "pieces": self._pieces,
                    "busy": self._busy,
                    "waited": self._waited,
                }
            )
            self._started = None

    def _timed(self, stage: str, started: float) -> None:
        self._busy[stage] += _now() - started  # += on a float under the GIL: a lost update only blurs a profile

    def _read(self, piece: Piece):
        started = _now()
        buffer = self.route.pool(piece).take(piece.count)
        read = read_piece(self.reader, piece, out=buffer)
        self._timed("read", started)
        return read, buffer

    def _make(self, piece: Piece, read, read_buffer):
        started = _now()
        pool = self.route.pool(piece)
        buffer = pool.take(piece.nbytes)
        event = piece.make(read, buffer[: piece.nbytes])
        pool.give(read_buffer, event)
        self._timed("make", started)
        return buffer[: piece.nbytes], event, buffer

    def _write(self, writer, name: str, piece: Piece, made, event, buffer) -> None:
        started = _now()
        if event is not None:
            event.synchronize()
        writer.write(name, made, offset=piece.offset)
        if piece.watched and name not in self.infinite and holds_inf(as_array(made)):
            self.infinite.add(name)
        self.route.pool(piece).give(buffer)
        self._timed("write", started)
        profile.mark("first piece written")

    def _result(self, stage: str, future):
        started = _now()
        result = future.result()
        self._waited[stage] += _now() - started
        return result

    def push(self, writer, name: str, piece: Piece) -> None:
        self._pieces += 1
        self._reads.append((writer, name, piece, self._readers.submit(self._read, piece)))
        self._step(READ_AHEAD, self.route.makers, WRITE_AHEAD)

    def drain(self) -> None:
        self._step(0, 0, 0)

    def _step(self, reads: int, makes: int, writes: int) -> None:

        while len(self._reads) > reads:
            writer, name, piece, future = self._reads.popleft()
            read, buffer = self._result("read", future)
            if piece.make is None:  # the bytes read are the output
                made = Future()
                made.set_result((read, None, buffer))
            else:
                made = self._makers.submit(self._make, piece, read, buffer)
            self._makes.append((writer, name, piece, made))
            self._retire_makes(makes)
        self._retire_makes(makes)
        self._retire_writes(writes)

    def _retire_makes(self, makes: int) -> None:
        while len(self._makes) > makes:
            writer, name, piece, future = self._makes.popleft()
            made = self._result("make", future)
            self._writes.append((piece, self._writers.submit(self._write, writer, name, piece, *made)))
            self._retire_writes(WRITE_AHEAD)

    def _retire_writes(self, writes: int) -> None:
        while len(self._writes) > writes:
            piece, future = self._writes.popleft()
            self._result("write", future)
            self.progress(piece.nbytes)


def holds_inf(raw) -> bool:
    """Whether fp16 bytes (a uint8 numpy array) hold ±inf: the largest magnitude's bits first (one pass and a
    reduction), the elements only where that is inf or NaN (a NaN is larger: it hides them)."""
    import numpy as np

    magnitudes = np.bitwise_and(raw.view(np.uint16), 0x7FFF)
    return magnitudes.size > 0 and int(magnitudes.max()) >= 0x7C00 and bool((magnitudes == 0x7C00).any())


def _now() -> float:

    return time.perf_counter()
