"""GGUF tensors written piece by piece as the pipeline makes them, each piece converted and written at its place in the
file by the pipeline's writing threads: such a tensor is never whole in memory.

A tensor the fast paths take (``fast.py``) whose layout steps all keep the values' order (``fast.ORDER_KEEPING``:
reshape, view, contiguous...) holds in the GGUF our values in our order. So the piece at bytes ``[offset, offset + n)``
of our tensor is GGUF bytes at a place known from the piece alone, once the file's ``Layout`` is known (where the data
section begins, after the metadata the converter writes while the first pieces are made: until then their bytes are
held, a bounded amount):

- ``same``: the same bytes (fp16 to f16, fp32 to f32), or for bf16 the same with every NaN's quiet bit set, as gguf-py's
  rounding from fp32 writes them;
- ``q8_0``: the piece's whole 32-value blocks quantized where they stand (``q8_0.Q8_0``, on the route's device); a block
  a piece's edge cuts (pieces are cut at the source's quant blocks or rows, not at 32 values) is gathered from its
  pieces as they come and quantized once whole.

Each range written has its writeback started at once, as the dense route's shards do.
"""

from __future__ import annotations

import os
import threading

from .q8_0 import BLOCK, BLOCK_BYTES, Q8_0, quiet_bf16

HELD_BYTES = 64 << 20  # streamed bytes held until the file's layout is known: the pipeline goes on meanwhile


class _Stopped(Exception):
    """The file's layout will not come: the conversion failed or stopped elsewhere (that failure is reported)."""


class Layout:
    """Where each GGUF tensor's bytes begin in the file: known once the converter's writer has laid out its metadata
    (which it does while the first tensors are made). Until then the bytes of streamed pieces are held here, up to
    ``limit`` bytes, then their writers wait."""

    def __init__(self, limit: int | None = None):
        self._changed = threading.Condition()
        self._offsets: dict[str, int] | None = None
        self._error: BaseException | None = None
        self._held: list[tuple[str, int, object]] = []  # (tensor, byte in it, bytes)
        self._held_bytes = 0
        self._limit = HELD_BYTES if limit is None else limit

    def set(self, offsets: dict[str, int]) -> list[tuple[int, object]]:
        """The offsets are known: what was held, as (position in the file, bytes), for the caller to write."""
        with self._changed:
            self._offsets = offsets
            held, self._held, self._held_bytes = self._held, [], 0
            self._changed.notify_all()
        return [(offsets[name] + position, data) for name, position, data in held]

    def fail(self, error: BaseException | None = None) -> None:
        """No layout will come (``error``: why; None: stopped): the pieces waiting for it raise."""
        with self._changed:
            if self._offsets is None and self._error is None:
                self._error = error or _Stopped()
            self._held, self._held_bytes = [], 0
            self._changed.notify_all()

    def place(self, name: str, position: int, data) -> int | None:
        """Where in the file byte ``position`` of tensor ``name`` goes; None where ``data`` (bytes of it, a numpy
        array the caller gives up) is held until the offsets are known."""
        with self._changed:
            if self._offsets is None and self._error is None and self._held_bytes + data.nbytes <= self._limit:
                self._held.append((name, position, data))
                self._held_bytes += data.nbytes
                return None
            while self._offsets is None and self._error is None:
                self._changed.wait()
            if self._error is not None:
                raise self._error
            return self._offsets[name] + position


class GgufFileWrites:
    """Positional writes into the GGUF file (its descriptor) at places the ``layout`` gives, each range's writeback
    started at once; and each writing thread's Q8_0 quantizer on ``device`` (``edge_blocks``: gguf-py's, for the blocks
    torch leaves alone)."""

    def __init__(self, descriptor: int, layout: Layout, device, edge_blocks, writeback=None):
        self.descriptor, self.layout, self.device, self._edge_blocks = descriptor, layout, device, edge_blocks
        self._writeback = writeback
        self._flush = writeback.open(descriptor) if writeback is not None else None
        self._local = threading.local()

    def put(self, name: str, position: int, data, owned: bool) -> None:
        """Bytes (a contiguous numpy array) at byte ``position`` of tensor ``name``; ``owned``: the caller gives them
        up (else they are copied if held)."""
        if self.layout._offsets is None:  # a peek: place() decides under its lock
            kept = data if owned else data.copy()
            at = self.layout.place(name, position, kept)
            if at is None:
                return
        else:
            at = self.layout.place(name, position, data)
        self.pwrite(data, at)

    def pwrite(self, data, position: int) -> None:
        view = memoryview(data).cast("B")
        while len(view):  # a regular file takes at most ~2 GiB per call
            done = os.pwrite(self.descriptor, view, position)
            if self._writeback is not None:
                self._writeback.request(self._flush, position, done)
            view, position = view[done:], position + done

    def quantizer(self) -> Q8_0:
        """This thread's quantizer (its buffers its own; on a GPU, its own stream), torch on one core on a CPU: the
        writing threads are the parallelism."""
        quantize = getattr(self._local, "q8_0", None)
        if quantize is None:
            import torch

            if torch.device(self.device).type == "cpu":
                torch.set_num_threads(1)  # this thread's setting alone
                self._local.stream = None
            else:
                self._local.stream = torch.cuda.Stream(self.device)
            quantize = self._local.q8_0 = Q8_0(self.device, self._edge_blocks)
        return quantize

    def stream(self):
        return self._local.stream

    def close(self) -> None:
        if self._writeback is not None:
            self._writeback.release(self._flush)


class StreamedTensor:
    """One GGUF tensor written as its pieces are made: the pipeline's writer for it (``write(name, data, offset)``,
    from any number of threads). ``name``: its GGUF name; ``kind``: "same" or "q8_0"; ``dtype``: our tensor's torch
    dtype; ``nbytes``: its GGUF bytes. ``retyped`` (a ``requant.Retyped``): the "same" bytes are llama-quantize's
    input, quantized a run of whole rows at a time (a row a piece's edge cuts gathered from its pieces)."""

    def __init__(self, name: str, kind: str, dtype, nbytes: int, file: GgufFileWrites, retyped=None):
        self.name, self.kind, self.dtype, self.nbytes, self._file = name, kind, dtype, nbytes, file
        self.retyped = retyped
        self._itemsize = dtype.itemsize
        self._seams: dict[int, list] = {}  # blocks (rows) cut by a piece's edge: index -> [values, missing count]
        self._lock = threading.Lock()

    def write(self, source: str, data, offset: int) -> None:
        import numpy as np
        import torch

        from ...errors import InternalError
        from ...safetensors_io.read import as_array

        if offset % self._itemsize or len(as_array(data)) % self._itemsize:
            raise InternalError(f"{source}: a piece at byte {offset} cuts a value")
        if self.kind == "same":
            raw = np.ascontiguousarray(as_array(data)).reshape(-1).view(np.uint8)
            if self.dtype == torch.bfloat16:
                quieted = quiet_bf16(torch.from_numpy(raw).view(torch.int16)).view(torch.uint8).numpy()
                owned, raw = not np.may_share_memory(quieted, raw), quieted
            else:
                owned = False  # the pipeline's buffer, reused once this returns
            if self.retyped is not None:
                self._requantized(raw, offset)
                return
            if offset + raw.size > self.nbytes:
                raise InternalError(f"{source}: bytes up to {offset + raw.size} of a GGUF tensor of {self.nbytes}")
            self._file.put(self.name, offset, raw, owned)
            return
        values = data if isinstance(data, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(data))
        values = values.reshape(-1).view(torch.uint8).view(self.dtype)
        first = offset // self._itemsize
        last = first + values.numel()
        if last // BLOCK * BLOCK_BYTES > self.nbytes:
            raise InternalError(f"{source}: values up to {last} of a GGUF tensor of {self.nbytes} Q8_0 bytes")
        begin, end = -(-first // BLOCK) * BLOCK, last // BLOCK * BLOCK  # the whole blocks the piece holds
        if begin < end:
            self._quantized(values[begin - first : end - first], begin // BLOCK * BLOCK_BYTES)
        for low, high in ((first, min(begin, last)), (max(end, begin), last)):
            if low < high:
                self._seam(values[low - first : high - first], low)

    def _quantized(self, values, position: int) -> None:
        """Whole blocks quantized on this thread's quantizer, chunk by chunk, and put from byte ``position`` of this
        tensor."""
        import contextlib

        import torch

        quantize = self._file.quantizer()
        stream = self._file.stream()
        step = quantize.chunk_values
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for first in range(0, values.numel(), step):
                chunk = values[first : first + step]
                if chunk.device != quantize.device:
                    chunk = chunk.to(quantize.device)
                made = quantize(chunk).to("cpu", copy=True).numpy()  # out of the quantizer's buffers, reused next
                self._file.put(self.name, position + first // BLOCK * BLOCK_BYTES, made, owned=True)

    def _seam(self, values, first: int) -> None:
        """Values ``[first, first + n)`` of one block a piece's edge cut: kept until the block is whole."""
        import torch

        block = first // BLOCK
        with self._lock:
            gathered = self._seams.get(block)
            if gathered is None:
                gathered = self._seams[block] = [torch.empty(BLOCK, dtype=self.dtype), BLOCK]
            gathered[0][first - block * BLOCK : first - block * BLOCK + values.numel()] = values.cpu()
            gathered[1] -= values.numel()
            if gathered[1]:
                return
            del self._seams[block]
        self._quantized(gathered[0], block * BLOCK_BYTES)

    def _requantized(self, raw, offset: int) -> None:
        """IN's bytes ``[offset, offset + n)`` of this tensor: its whole rows quantized where they stand, the rest
        gathered."""
        width = self.retyped.source_row_bytes
        first, last = offset, offset + raw.size
        begin, end = -(-first // width) * width, last // width * width  # the whole rows the piece holds
        if begin < end:
            self._rows(raw[begin - first : end - first], begin // width)
        for low, high in ((first, min(begin, last)), (max(end, begin), last)):
            if low < high:
                self._row_seam(raw[low - first : high - first], low)

    def _rows(self, raw, row: int) -> None:
        made = self.retyped.quantize(raw, row)
        self._file.put(self.name, row * self.retyped.row_bytes, made, owned=True)

    def _row_seam(self, raw, first: int) -> None:
        import numpy as np

        width = self.retyped.source_row_bytes
        row = first // width
        with self._lock:
            gathered = self._seams.get(row)
            if gathered is None:
                gathered = self._seams[row] = [np.empty(width, dtype=np.uint8), width]
            gathered[0][first - row * width : first - row * width + raw.size] = raw
            gathered[1] -= raw.size
            if gathered[1]:
                return
            del self._seams[row]
        self._rows(gathered[0], row)

    def complete(self) -> bool:
        """Whether no block waits for the rest of its values (every piece written, this must hold)."""
        return not self._seams
