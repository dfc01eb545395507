"""Planned tensors made whole ahead of the GGUF writer, in the order it will ask for them.

The converter's writer asks for one tensor at a time. Made one at a time on the asking thread, a tensor would be read
and decoded piece after piece on one core; instead a thread of our own pushes the tensors' pieces through the pipeline
(``pipeline/core.py``: reads, the route's makers, writes) into host memory, in the writer's order, while the writer
converts and writes the tensors before. At most ``ahead`` bytes are made and not yet taken (one tensor whatever its
size), so memory stays at the tensor being written, ``ahead`` bytes and the pipeline's pieces.

The feed starts on a forecast of that order (the converter's reading order), while the converter sets up; the writer's
own order replaces it once known (``expect``). A tensor asked for out of order (the converter evaluating one early, or
twice) is made on the asking thread.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

from ...kinds.base import whole
from ...pipeline.core import Pipeline
from ...plan import may_exceed

AHEAD_BYTES = 256 << 20  # made, not yet taken: enough to keep the writer fed, little beside the largest tensor


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
    """Planned tensors by name, made ahead through the pipeline; ``take(name)`` hands one over (a CPU torch tensor of
    its dtype and shape) and forgets it."""

    def __init__(self, plan, reader, route, *, writers: int, progress: Callable[[int], None], ahead=AHEAD_BYTES):
        self._tensors = {tensor.name: tensor for tensor in plan.tensors}
        self._plan, self._reader, self._route, self._writers, self._progress = plan, reader, route, writers, progress
        self._ahead = ahead
        self._made: dict[str, _Made] = {}
        self._pending = 0  # bytes made or being made, not yet taken
        self._changed = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._queue: deque = deque()
        self._wanted: set[str] = set()
        self._taken: set[str] = set()
        self.infinite: list[str] = []  # fp16 tensors written with ±inf (plan.may_exceed), as the pipeline found them

    def start(self, order: list[str]) -> None:
        """Make the tensors named in ``order`` (each once), in that order, on a thread of their own."""
        with self._changed:
            self._queue = deque(dict.fromkeys(name for name in order if name in self._tensors))
            self._wanted = set(self._queue)
        self._thread = threading.Thread(target=self._run, name="nf4convert-gguf-feed", daemon=True)
        self._thread.start()

    def expect(self, order: list[str]) -> None:
        """The order the writer will ask in, once known (``start`` was given a forecast): what it will not ask for is
        dropped, and the rest is made in this order."""
        with self._changed:
            wanted = dict.fromkeys(name for name in order if name in self._tensors and name not in self._taken)
            for name in [name for name in self._made if name not in wanted]:
                self._pending -= self._made.pop(name).tensor.nbytes
            self._queue = deque(name for name in wanted if name not in self._made)
            self._wanted = set(wanted)
            self._changed.notify_all()

    def _next(self) -> str | None:
        with self._changed:
            return self._queue.popleft() if self._queue and not self._stop else None

    def _run(self) -> None:
        try:
            self._route.warm(self._plan, self._reader)
            made_names = []
            with Pipeline(self._route, self._reader, self._progress, writers=self._writers) as pipeline:
                while (name := self._next()) is not None:
                    tensor = self._tensors[name]
                    if not self._room(tensor.nbytes, pipeline):
                        return
                    made = _Made(tensor, self._notify)
                    with self._changed:
                        if name not in self._wanted or name in self._made:  # the order changed meanwhile
                            continue
                        self._made[name] = made
                        self._pending += tensor.nbytes
                    made_names.append(name)
                    watched = may_exceed(tensor)
                    for piece in tensor.recipe.produce(tensor, self._reader, self._route):
                        if self._stop:
                            return
                        piece.watched = watched
                        pipeline.push(made, name, piece)
                    if made.complete:
                        self._notify()
                pipeline.drain()
                self.infinite += [name for name in made_names if name in pipeline.infinite]
        except BaseException as error:  # noqa: BLE001  (handed to the thread that takes the tensors)
            with self._changed:
                self._error = error
                self._changed.notify_all()

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
            while not self._stop and self._pending > 0 and self._pending + nbytes > self._ahead:
                self._changed.wait()
            return not self._stop

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def take(self, name: str):
        """Tensor ``name`` made whole: a CPU torch tensor of its planned dtype and shape."""
        from ...dtypes import DTYPES

        tensor = self._tensors[name]
        with self._changed:
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

    def close(self) -> None:
        """Stop making tensors ahead and wait for the pieces in flight."""
        with self._changed:
            self._stop = True
            self._changed.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
