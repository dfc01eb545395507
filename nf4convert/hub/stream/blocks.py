"""A block of a file held in memory, and a position that reads of a file continue from."""

from __future__ import annotations

import threading

from ...errors import Nf4ConvertError


class Block:
    """``[first, end)`` of a file, held: fetched (``done``, or its ``error``), hashed, read (``served`` bytes), and
    in use by ``pins`` reads or the hasher."""

    __slots__ = ("index", "first", "end", "buffer", "data", "done", "error", "hashed", "served", "pins")

    def __init__(self, index: int, first: int, end: int, buffer: bytearray):
        self.index, self.first, self.end = index, first, end
        self.buffer = buffer  # a block's size, reused by the blocks after it: the process's memory stays flat
        self.data = memoryview(buffer)[: end - first]
        self.done = threading.Event()
        self.error: Nf4ConvertError | None = None
        self.hashed = False
        self.served = 0
        self.pins = 0


class Stream:
    """A position reads of a file continue from: the end of the last one, how many continued it and their bytes."""

    __slots__ = ("end", "hits", "read", "largest", "used")

    def __init__(self, end: int, read: int, tick: int):
        self.end, self.hits, self.read, self.largest, self.used = end, 1, read, read, tick

    def ahead(self, block_bytes: int, most: int) -> int:
        """Blocks to prefetch: none for a read or two of small bytes (a header, quant states), then more as it
        proves to be a stream, up to ``most`` blocks or a few of its reads (several threads read one stream)."""
        if self.hits < 2 or self.read < block_bytes // 2:
            return 0
        return min(max(most, -(-_READS_AHEAD * self.largest // block_bytes)), 1 + self.read // block_bytes)


STALE_READS = 256  # reads (of any file) after which a stream not continued is forgotten
_READS_AHEAD = 4  # a stream prefetches at least this many of its largest reads: the pipeline reads a few at once
