"""The GGUF's tensors made through the pipeline, in the order the file holds them: streamed to the file, or made whole
ahead of the thread that writes the rest.

One thread of our own pushes every tensor's pieces through one pipeline (``pipeline/core.py``: reads, the route's
makers, several writing threads) in the file's order. A tensor the file holds in our values' order (``streamed.py``)
has its pieces written straight to their places in the file by the pipeline's writers: it is never whole. Any other
(a reordering layout step such as the q/k permute, or a graph only the converter's code converts) is made whole into
host memory, for the writing thread to take (``take``) and convert; at most ``ahead`` bytes are made and not yet taken
(one tensor whatever its size), so memory stays at the tensor being converted, ``ahead`` bytes and the pipeline's
pieces. A tensor asked for out of order (the converter evaluating one early, or twice) is made on the asking thread.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

from ...kinds.base import whole
from ...pipeline.core import Pipeline
from ...plan import may_exceed

AHEAD_BYTES = 256 << 20  # made whole, not yet taken: enough to keep the writer fed, little beside the largest tensor


class _Made:
    """One tensor's bytes as the pipeline's writers put its pieces in (the pipeline's sink interface: ``write``)."""

    def __init__(self, tensor, done: Callable[[], None]):
        import torch

        self.tensor = tensor
        self.bytes = torch.empty(tensor.nbytes, dtype=torch.uint8)
        self._missing = tensor.nbytes
        self._lock = threading.Lock()
        self._done = done
        self.complete = tensor.nbytes == 0

    def write(self, name: str, data, offset: int) -> None:
        import numpy as np

        from ...safetensors_io.read import as_array

        data = np.ascontiguousarray(as_array(data)).reshape(-1).view(np.uint8)
        self.bytes.numpy()[offset : offset + data.size] = data
        with self._lock:
            self._missing -= data.size
            finished = self._missing == 0
        if finished:
            self.complete = True
            self._done()


class Feed:
    """Planned tensors by name, made through the pipeline in the order given to ``start``: each one streamed to the
    writer ``start`` pairs it with, or made whole for ``take(name)`` (a CPU torch tensor of its dtype and shape)."""

    def __init__(self, plan, reader, route, *, writers: int, progress: Callable[[int], None], ahead=AHEAD_BYTES):
        self._tensors = {tensor.name: tensor for tensor in plan.tensors}
        self._plan, self._reader, self._route, self._writers, self._progress = plan, reader, route, writers, progress
        self._ahead = ahead
        self._made: dict[str, _Made] = {}
        self._pending = 0  # bytes made or being made whole, not yet taken
        self._changed = threading.Condition()
        self._stop = False
        self._done = False  # every tensor of the order pushed and its pieces written
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._queue: deque = deque()  # (name, its stream's writer or None: made whole), in the order made
        self._wholes: deque = deque()  # the names made whole, in that order, until each is begun
        self._crowded = False  # the feed waits for room (the writer to take what is made)
        self._taken: set[str] = set()
        self.infinite: list[str] = []  # fp16 tensors written with ±inf (plan.may_exceed), as the pipeline found them

    def start(self, order: list) -> None:
        """Make the tensors ``order`` names, in that order, on a thread of their own: a name is made whole once, for
        ``take``; a ``(name, writer)`` pair has the tensor's pieces written to ``writer`` (the pipeline's sink
        interface, ``write(name, data, offset)``) as they are made."""
        jobs, wholes = [], []
        for item in order:
            name, writer = item if isinstance(item, tuple) else (item, None)
            if name not in self._tensors or (writer is None and name in wholes):
                continue
            jobs.append((name, writer))
            if writer is None:
                wholes.append(name)
        with self._changed:
            self._queue = deque(jobs)
            self._wholes = deque(wholes)
        self._thread = threading.Thread(target=self._run, name="nf4convert-gguf-feed", daemon=True)
        self._thread.start()

    def _next(self):
        with self._changed:
            return self._queue.popleft() if self._queue and not self._stop else None

    def _run(self) -> None:
        try:
            self._route.warm(self._plan, self._reader)
            made_names = []
            with Pipeline(self._route, self._reader, self._progress, writers=self._writers) as pipeline:
                while (job := self._next()) is not None:
                    name, writer = job
                    tensor = self._tensors[name]
                    if writer is None:
                        writer = self._register(tensor, pipeline)
                        if writer is None:  # taken (made) on the asking thread meanwhile
                            continue
                    made_names.append(name)
                    watched = may_exceed(tensor)
                    for piece in tensor.recipe.produce(tensor, self._reader, self._route):
                        if self._stop:
                            return
                        piece.watched = watched
                        pipeline.push(writer, name, piece)
                    if isinstance(writer, _Made) and writer.complete:
                        self._notify()
                pipeline.drain()
                self.infinite += [name for name in dict.fromkeys(made_names) if name in pipeline.infinite]
            with self._changed:
                self._done = not self._stop
                self._changed.notify_all()
        except BaseException as error:  # noqa: BLE001  (handed to the thread that takes the tensors)
            with self._changed:
                self._error = error
                self._changed.notify_all()

    def _register(self, tensor, pipeline) -> _Made | None:
        """The next tensor made whole, once there is room for it (None: already taken, or stopped)."""
        room = self._room(tensor.nbytes, pipeline)
        with self._changed:
            if self._wholes and self._wholes[0] == tensor.name:
                self._wholes.popleft()
            self._changed.notify_all()
            if not room or tensor.name in self._taken:
                return None
            made = self._made[tensor.name] = _Made(tensor, self._notify)
            self._pending += tensor.nbytes
            return made

    def _room(self, nbytes: int, pipeline) -> bool:
        """Wait until ``nbytes`` more may be made (always, when nothing is waiting to be taken); False once stopped.
        The pieces in flight land first: the tensor they finish may be the one the writer waits for."""
        with self._changed:
            if self._stop:
                return False
            if self._pending == 0 or self._pending + nbytes <= self._ahead:
                return True
        pipeline.drain()
        with self._changed:
            self._crowded = True  # a take of the tensor waiting here makes it itself (it may be asked for first)
            self._changed.notify_all()
            try:
                while not self._stop and self._pending > 0 and self._pending + nbytes > self._ahead:
                    self._changed.wait()
            finally:
                self._crowded = False
            return not self._stop

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def take(self, name: str):
        """Tensor ``name`` made whole: a CPU torch tensor of its planned dtype and shape."""
        from ...dtypes import DTYPES

        tensor = self._tensors[name]
        with self._changed:
            # the next tensor the feed makes whole is waited for, not made twice (unless the feed waits for room)
            while (
                name not in self._made
                and self._wholes
                and self._wholes[0] == name
                and not self._crowded
                and self._error is None
                and not self._stop
            ):
                self._changed.wait()
            made = self._made.get(name)
            while made is not None and not made.complete and self._error is None:
                self._changed.wait()
            if self._error is not None:
                raise self._error
            self._taken.add(name)
            if made is not None:
                del self._made[name]
                self._pending -= tensor.nbytes
                self._changed.notify_all()
        if made is None:  # not (or no longer) made ahead: made here
            raw = whole(tensor, self._reader, self._route)
        else:
            raw = made.bytes
        return raw.view(DTYPES[tensor.dtype].torch).view(tensor.shape)

    def finish(self) -> None:
        """Wait until every tensor of the order is made and every streamed piece written; the feed's failure is
        raised here."""
        with self._changed:
            while not self._done and self._error is None and self._thread is not None:
                self._changed.wait()
            if self._error is not None:
                raise self._error

    def close(self) -> None:
        """Stop making tensors and wait for the pieces in flight."""
        with self._changed:
            self._stop = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
