"""The CUDA route: pieces made on one GPU. One maker thread only enqueues: host-to-device copies on their own stream,
the kernel on the current stream, device-to-host copies into pinned buffers on a third stream, ordered by events; the
writer waits on a piece's event before writing it. Plain tensors that need no cast are written from the very buffer
they were read into: they never reach the GPU. Casts stay on the CPU (so both routes write the same bits).

The route starts in the background (context, streams, device buffers, a warm-up launch of the kernel for the plan's
first 4-bit piece), so plain tensors are read and written meanwhile; the first piece the GPU makes waits for it.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Iterator

from ... import profile
from ...safetensors_io.read import TensorReader
from ..piece import Buffers, Piece, pieces_from_memory

CUDA_PIECE_BYTES = 1 << 24  # large copies and writes, a few pinned buffers of it


class _Slot:
    """Device buffers for one piece in flight, and the event after which they are free again."""

    def __init__(self, size: int, device):
        import torch

        self.packed = torch.empty(size, dtype=torch.uint8, device=device)
        self.out = torch.empty(size, dtype=torch.uint8, device=device)
        self.free = None
        self.keep = None  # a result the device-to-host copy still reads


class CudaRoute:
    """Pieces made on one GPU (``base.Route`` says what a route answers): one maker thread enqueues copies and
    kernels, nothing waits on the host but the writer (for its piece's event) and a reused pinned buffer (for the copy
    that last read it).

    The route starts on a thread of its own (CUDA's context, streams, device buffers, then a warm-up launch
    of the kernel for the plan's first 4-bit piece, which loads or compiles it), so plain tensors are read
    and written meanwhile; the first piece the GPU makes waits for it."""

    piece_bytes = CUDA_PIECE_BYTES
    gpu = True
    makers = 1  # enqueues only; one thread keeps the streams' order simple
    slots = 3  # pieces on the device at once: one copied in, one made, one copied out

    def __init__(self, device):
        from concurrent.futures import ThreadPoolExecutor

        import torch

        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self._pinned = Buffers(self.piece_bytes, pinned=True)  # pieces the GPU makes
        self._host = Buffers(self.piece_bytes, pinned=False)  # pieces made (or only copied) on the CPU
        self._slots: list = []
        self._turn = 0
        self._lock = threading.Lock()  # the maker thread enqueues, and so may a producer (an adapter merge)
        self._starter = ThreadPoolExecutor(1, thread_name_prefix="nf4convert-cuda-start")
        self._ready = self._starter.submit(self._start)

    def _start(self) -> None:
        import torch

        torch.cuda.set_device(self.device)
        self._upload, self._download = torch.cuda.Stream(), torch.cuda.Stream()
        self._slots = [_Slot(self.piece_bytes, self.device) for _ in range(self.slots)]
        profile.mark("cuda started")

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        import torch

        self._starter.shutdown(wait=True, cancel_futures=True)  # a start not begun yet is cancelled
        if self._ready.done() and not self._ready.cancelled() and self._ready.exception() is None:
            torch.cuda.synchronize(self.device)  # no copy may still read or write a buffer after this
        self._slots.clear()

    def pool(self, piece: Piece) -> Buffers:
        return self._pinned if piece.on_device else self._host

    def warm(self, plan, reader: TensorReader) -> None:
        """Launch the kernel once, on the start thread, as the plan's first 4-bit piece will (its output thrown away;
        a failure here is the first real piece's to report)."""
        first = next((tensor for tensor in plan.tensors if tensor.recipe.innermost().uses_kernel), None)
        if first is not None:
            self._starter.submit(self._warm, dataclasses.replace(first, recipe=first.recipe.innermost()), reader)

    def _warm(self, tensor, reader: TensorReader) -> None:
        import torch

        self._ready.result()
        piece = next(tensor.recipe.produce(tensor, reader, self))
        read = torch.zeros(piece.count, dtype=torch.uint8, pin_memory=True)
        out = torch.empty(piece.nbytes, dtype=torch.uint8, pin_memory=True)
        piece.make(read, out).synchronize()
        profile.mark("kernel warmed")

    def maker_started(self) -> None:
        import torch

        torch.cuda.set_device(self.device)

    def make(self, host: Callable | None, device: Callable | None = None) -> Callable:
        """``device`` through this route's slots and streams; without one, ``host`` on the maker thread (a cast: on
        the CPU, so that both routes write the same bits)."""
        return host if device is None else _DeviceMake(self, device)

    def _run(self, read, out, compute):
        """Copy ``read`` in, ``compute(device bytes in, device bytes out) -> device result``, copy the result out."""
        self._ready.result()
        with self._lock:
            return self._enqueue(read, out, compute)

    def _enqueue(self, read, out, compute):
        import torch

        slot = self._slots[self._turn]
        self._turn = (self._turn + 1) % len(self._slots)
        if slot.packed.numel() < read.numel() or slot.out.numel() < out.numel():  # an 8-bit row beyond a piece
            if slot.free is not None:
                slot.free.synchronize()
            slot.__init__(max(read.numel(), out.numel()), self.device)
        with torch.cuda.stream(self._upload):
            if slot.free is not None:
                self._upload.wait_event(slot.free)
            device_in = slot.packed[: read.numel()]
            device_in.copy_(read, non_blocking=True)
            loaded = self._upload.record_event()
        compute_stream = torch.cuda.current_stream(self.device)
        compute_stream.wait_event(loaded)
        result = compute(device_in, slot.out[: out.numel()])
        made = compute_stream.record_event()
        with torch.cuda.stream(self._download):
            self._download.wait_event(made)
            out.copy_(result, non_blocking=True)
            slot.free = self._download.record_event()
        slot.keep = result  # the device-to-host copy reads it: alive until the slot comes round again
        return slot.free

    def make_into(self, piece: Piece, read, target) -> None:
        """Make ``piece`` from ``read`` (host bytes) into ``target``: in device memory straight from the kernel (no
        round trip through the host) where the GPU makes it, else on the host and copied in; or into host memory."""
        import torch

        if target.is_cuda and isinstance(piece.make, (_DeviceMake, _FromDevice)):
            piece.make.into(read, target)
        elif target.is_cuda:  # made on the host (a cast, bytes already in memory)
            made = torch.empty(piece.nbytes, dtype=torch.uint8)
            piece.make(read.numpy(), made.numpy())
            target.copy_(made)
        elif isinstance(piece.make, (_DeviceMake, _FromDevice)):
            piece.make(read, target).synchronize()
        else:
            piece.make(read.numpy(), target.numpy())

    def pieces_of(self, data, source) -> Iterator[Piece]:
        """A tensor already made (raw bytes), handed to the writers piece by piece. One in this GPU's memory (a merged
        weight) stays there and is copied out a piece at a time into the reused pinned buffers, so host memory holds
        a few pieces, not the weight; one in host memory is handed over as it is."""
        import torch

        if not data.is_cuda:
            yield from pieces_from_memory(data, source, self.piece_bytes)
            return
        ready = torch.cuda.current_stream(data.device).record_event()  # the work that made ``data`` is enqueued
        for first in range(0, data.numel(), self.piece_bytes):
            part = data[first : first + self.piece_bytes]
            yield Piece(first, part.numel(), source, 0, 0, _FromDevice(self, part, ready), on_device=True)


class _FromDevice:
    """A piece of a tensor already in device memory: called as ``make(read, out)`` (``read`` is empty), it copies the
    piece into host ``out`` on the route's download stream once ``ready`` has passed and returns the copy's event."""

    def __init__(self, route: "CudaRoute", part, ready):
        self.route, self.part, self.ready = route, part, ready

    def __call__(self, read, out):
        import torch

        route = self.route
        route._ready.result()
        with route._lock, torch.cuda.stream(route._download):
            route._download.wait_event(self.ready)
            out.copy_(self.part, non_blocking=True)
            return route._download.record_event()

    def into(self, read, target) -> None:
        import torch

        torch.cuda.current_stream(target.device).wait_event(self.ready)
        target.copy_(self.part)


class _DeviceMake:
    """A piece made on the GPU: called as ``make(read, out)`` it goes through the route's slots and streams into
    host ``out``; ``compute(device bytes in, device bytes out) -> device result`` is the kernel step alone."""

    def __init__(self, route: "CudaRoute", compute: Callable):
        self.route, self.compute = route, compute

    def __call__(self, read, out):
        return self.route._run(read, out, self.compute)

    def into(self, read, target) -> None:
        """Make the piece straight into device memory ``target`` (a weight made whole on the GPU)."""
        self.route._ready.result()
        with self.route._lock:  # one thread launches at a time, as through _run
            result = self.compute(read.to(target.device), target)
            if result.data_ptr() != target.data_ptr():
                target.copy_(result)
