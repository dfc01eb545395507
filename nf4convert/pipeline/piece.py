"""A piece: a slice of one output tensor and how it is made, the unit every stage of the pipeline moves; the host
buffers pieces are read and made into.

A kind's producer (``kinds/``) cuts its tensor into pieces of at most ``route.piece_bytes`` (whole quant blocks, whole
8-bit rows) and gives each piece the ``make`` a route (``pipeline/routes/``) builds from the kind's own computations.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from ..safetensors_io.read import TensorInfo, as_array


@dataclass
class Piece:
    """``nbytes`` output bytes at byte ``offset`` of an output tensor, made from ``count`` bytes of ``source``
    from byte ``first``; ``make(read, out) -> event or None`` fills ``out`` (None: the bytes read are the output)."""

    offset: int
    nbytes: int
    source: TensorInfo
    first: int
    count: int
    make: Optional[Callable] = None
    on_device: bool = False  # made on the route's device (its buffers pinned on CUDA), not on the CPU
    watched: bool = False  # fp16 bytes checked for ±inf when written (plan.may_exceed)
    # Bytes that are not one range of ``source`` (a block of columns of every row: ``Columns``):
    # ``load(reader, out) -> out[:count]`` gives them in place of the positional read.
    load: Optional[Callable] = None


def read_piece(reader, piece: Piece, out=None):
    """The ``count`` bytes a piece is made from: its range of ``source``, or what its ``load`` gathers; into ``out``
    (a uint8 numpy array or CPU tensor, returned as ``out[:count]``) or a new uint8 tensor."""
    if piece.load is None:
        return reader.read(piece.source, piece.first, piece.count, out=out)
    if out is None:
        import torch

        out = torch.empty(piece.count, dtype=torch.uint8)
    return piece.load(reader, out)


class Columns:
    """A 2-D tensor whose pieces each need the same columns of every row (a weight packed transposed, so that an
    output row is a column of the packed tensor). A read per row would be one small read each, thousands a piece:
    instead the first piece to load reads the whole tensor in one sequential read, each piece gathers its columns
    from it in memory, and the tensor is let go once its last piece has loaded. Memory holds it (at most a quarter of
    the dense weight for 4-bit codes, half for 8-bit) only while its pieces are read; the reads stay sequential, and a
    source read over HTTP ranges (a Hub stream) reads it as any other tensor."""

    def __init__(self, source: TensorInfo, rows: int, loads: int):
        """``rows``: the tensor's first dimension; ``loads``: how many pieces will load from it."""
        self.source, self.rows, self._left = source, rows, loads
        self._data = None
        self._lock = threading.Lock()

    def load(self, first: int, count: int, reader, out):
        """Bytes ``[first, first + count)`` of every row, rows end to end, into ``out`` (``out[:rows * count]``)."""
        import numpy as np

        with self._lock:
            data = self._data
            if data is None:
                data = self._data = reader.array(self.source).reshape(self.rows, -1)
            self._left -= 1
            if self._left <= 0:
                self._data = None
        gathered = out[: self.rows * count]
        np.copyto(as_array(gathered).reshape(self.rows, count), data[:, first : first + count])
        return gathered


def pieces_from_memory(data, source: TensorInfo, piece_bytes: int) -> Iterator[Piece]:
    """A tensor already made (raw bytes in host memory), handed to the writers piece by piece."""
    data = as_array(data)
    for first in range(0, data.size, piece_bytes):
        count = min(piece_bytes, data.size - first)
        yield Piece(first, count, source, 0, 0, from_memory(data[first : first + count]))


def from_memory(data):
    def make(read, out):
        out[:] = data

    return make


class Buffers:
    """Reused host buffers: uint8 numpy arrays, or pinned uint8 tensors for the pieces a GPU makes. A buffer given back
    with an event is taken again only once that event has passed (a copy may still be reading it); one whose event
    has passed is taken first."""

    def __init__(self, size: int, pinned: bool, slots=None, overflow: "Buffers | None" = None):
        """``slots``: a fixed supply of buffers (the CPU route's shared mapping: ``slot(nbytes)`` a fresh one or None,
        ``holds(buffer)``); a request it cannot meet goes to ``overflow``, and such a buffer goes back there."""
        self._size, self._pinned, self._slots, self._overflow = size, pinned, slots, overflow
        self._free: list = []
        self._lock = threading.Lock()

    def take(self, nbytes: int):
        with self._lock:
            fitting = [i for i, (buffer, _) in enumerate(self._free) if buffer.nbytes >= nbytes]
            ready = [i for i in fitting if self._free[i][1] is None or self._free[i][1].query()]
            index = (ready or fitting or [None])[0]
            buffer, event = self._free.pop(index) if index is not None else (None, None)
        if buffer is None and self._slots is not None:
            with self._lock:
                buffer = self._slots.slot(nbytes)
            if buffer is None:
                return self._overflow.take(nbytes)
        if buffer is None and self._pinned:
            import torch

            buffer = torch.empty(max(nbytes, self._size), dtype=torch.uint8, pin_memory=True)
        elif buffer is None:  # pageable memory: a numpy array (the CPU route needs no torch)
            import numpy as np

            buffer = np.empty(max(nbytes, self._size), dtype=np.uint8)
        if event is not None:
            event.synchronize()
        return buffer

    def give(self, buffer, event=None) -> None:
        if self._slots is not None and not self._slots.holds(buffer):
            self._overflow.give(buffer, event)
            return
        with self._lock:
            self._free.append((buffer, event))
