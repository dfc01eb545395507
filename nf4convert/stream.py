"""Execute a plan: every output tensor's recipe, piece by piece, on one device, straight into its shard.

One pipeline serves both devices. A recipe's producer cuts its output into *pieces* of at most
``route.piece_bytes`` (whole quant blocks, whole 8-bit rows); each piece goes through three stages,
each on its own threads, so reading, making and writing overlap:

    read   positional reads of the source bytes into a reused host buffer        (reader threads)
    make   the output bytes from them: a cast on the CPU, or a dequantization     (the route's makers)
    write  positional writes at the piece's planned offset in its shard           (writer threads)

A *route* says how pieces are made on its device. The CPU route spreads makes over the cores: 4-bit and 8-bit
pieces in forked worker processes (workers.py; the CPU kernel works on whole blocks, so any piece stands alone),
casts on its maker threads (one call each, which releases the GIL). The CUDA
route keeps one maker thread that only enqueues: host-to-device copies on their own stream, the kernel
on the current stream, device-to-host copies into pinned buffers on a third stream, ordered by events;
the writer waits on a piece's event before writing it. Plain tensors that need no cast are written
from the very buffer they were read into: they never reach the GPU. Casts stay on the CPU on both routes
(so NaN payloads are the CPU's, the same on both).

Memory is bounded by the pieces in flight (``read_ahead + makers + write_ahead``, each at most
``piece_bytes`` in and out), whatever the model; buffers are reused, pinned on the CUDA route for the
pieces the GPU makes (a piece made on the CPU never takes pinned memory).

Every shard's header is written first (the plan fixed every offset), so pieces land in any order. Two
orders follow from that:

- shards are written ``SHARDS_AT_ONCE`` at a time, their pieces interleaved: buffered writes to one file
  serialize on its lock, writes to several run side by side;
- within a shard, plain tensors come first: they need no GPU, so they are written while the CUDA route
  starts (its context, buffers and a warm-up launch of the kernel run on a thread of their own).

Each range written has its writeback started at once (``checkpoint.Writeback``, on a thread of its own), so
the disk works from the first byte rather than from when the page cache's dirty threshold is reached.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from . import knobs, profile
from .safetensors_io.write import ShardWriter, Writeback
from .safetensors_io.read import TensorInfo, TensorReader, as_array
from .dtypes import DTYPES
from .formats import bnb4, bnb8, peft_lora
from .plan import Copy, Dequantize4bit, Dequantize8bit, MergeLora, Plan, PlannedTensor, Transpose, innermost, may_exceed

CPU_PIECE_BYTES = 1 << 22  # output bytes per piece on the CPU: small, as every core holds one (and its fp32 scratch)
CUDA_PIECE_BYTES = 1 << 24  # on CUDA: large copies and writes, a few pinned buffers of it
READ_AHEAD = 3  # pieces read before their make begins
WRITE_AHEAD = 3  # pieces made and waiting for (or being written by) the writers; more than one write in flight


SHARDS_AT_ONCE = knobs.value("NF4CONVERT_SHARDS_AT_ONCE")  # shards whose pieces are interleaved
WRITERS = knobs.value("NF4CONVERT_WRITERS")  # threads writing at once: one per shard written at once
# Threads making pieces on the CPU route: one per core, at most 8. On the H200 machine's 16 cores 8 made more
# than 16 (benchmarks/bench_cpu_scaling.py: 4.2-5.1 GB/s of bf16 against 3.8-4.1, the two runs of this code; the
# 8B conversion's pipeline 6.0 s against 6.4, with 517 MB of memory against 678): the decode is bound by memory
# and the interpreter's lock well before 16 cores, and the readers and writers need cores too.
MAX_MAKERS = knobs.value("NF4CONVERT_MAKERS")
# With 8 cores or more, the CPU route makes its 4-bit and 8-bit pieces in forked worker processes (workers.py), one
# per two cores, at most 8: the other half of the cores read, write and hand pieces over. On the H200 machine's 16
# cores (the 8B-shaped conversion, benchmarks/bench_convert.py) 8 processes took the pipeline to 4.2 s where threads
# took 6.7; 12 processes starved the writers of cores and took 11.6.
# NF4CONVERT_PROCESSES=0 keeps them on threads; a positive number is that many processes, at most one per core.
PROCESSES = knobs.value("NF4CONVERT_PROCESSES")
PROCESS_MIN_CORES, MAX_PROCESSES = 8, 8
# Start each range's writeback once written (checkpoint.Writeback); NF4CONVERT_WRITEBACK=0 (or off/false/no) not.
WRITEBACK = knobs.value("NF4CONVERT_WRITEBACK")


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


# --- producers: what each kind of recipe reads and makes ----------------------------------------------------


def _copy(tensor: PlannedTensor, reader: TensorReader, route) -> Iterator[Piece]:
    source = tensor.recipe.source
    source_type, target_type = DTYPES[source.dtype], DTYPES[tensor.dtype]
    cast = _cast(source.dtype, tensor.dtype) if source.dtype != tensor.dtype else None
    step = max(1, route.piece_bytes // max(source_type.itemsize, target_type.itemsize))  # elements
    n_elements = source.nbytes // source_type.itemsize
    for first in range(0, n_elements, step):
        count = min(step, n_elements - first)
        yield Piece(first * target_type.itemsize, count * target_type.itemsize, source, first * source_type.itemsize,
                    count * source_type.itemsize, cast)  # fmt: skip


def _dequantize_4bit(tensor: PlannedTensor, reader: TensorReader, route) -> Iterator[Piece]:
    weight = tensor.recipe.weight
    out_type = DTYPES[tensor.dtype]
    state = route.state_4bit(bnb4.load_state(weight, reader, dtype=tensor.dtype))
    for first, count, piece in bnb4.chunks(state, route.piece_bytes // out_type.itemsize):
        yield Piece(first * out_type.itemsize, count * out_type.itemsize, weight.packed, first // 2, (count + 1) // 2,
                    route.dequantize_4bit(piece), on_device=True)  # fmt: skip


def _dequantize_8bit(tensor: PlannedTensor, reader: TensorReader, route) -> Iterator[Piece]:
    weight = tensor.recipe.weight
    rows, columns = weight.shape
    out_type = DTYPES[tensor.dtype]
    scb = reader.tensor(weight.scb).to(route.device)
    step = max(1, route.piece_bytes // max(columns * out_type.itemsize, 1))  # whole rows: each has its own scale
    for first in range(0, rows, step):
        count = min(step, rows - first)
        yield Piece(first * columns * out_type.itemsize, count * columns * out_type.itemsize, weight.weight,
                    first * columns, count * columns, route.dequantize_8bit(scb[first : first + count], columns, out_type.torch),
                    on_device=True)  # fmt: skip


def _whole(tensor: PlannedTensor, reader: TensorReader, route, device="cpu"):
    """A recipe's tensor made whole through the route, as raw bytes in ``device``'s memory. On the GPU, pieces the
    GPU makes are made straight into it (no round trip through the host), the others copied in."""
    import torch

    whole = torch.empty(tensor.nbytes, dtype=torch.uint8, device=device)
    for piece in PRODUCERS[type(tensor.recipe)](tensor, reader, route):
        read = reader.read(piece.source, piece.first, piece.count)
        target = whole[piece.offset : piece.offset + piece.nbytes]
        if piece.make is None:
            target.copy_(read)
        elif target.is_cuda and isinstance(piece.make, _DeviceMake):
            piece.make.into(read, target)
        elif target.is_cuda:  # made on the host (a cast, bytes already in memory)
            made = torch.empty(piece.nbytes, dtype=torch.uint8)
            piece.make(read.numpy(), made.numpy())
            target.copy_(made)
        elif isinstance(piece.make, _DeviceMake):  # the CUDA route's piece into host memory
            piece.make(read, target).synchronize()
        else:  # the CPU route's makes take numpy arrays
            piece.make(read.numpy(), target.numpy())
    return whole


def _pieces_from_memory(data, source: TensorInfo, piece_bytes: int) -> Iterator[Piece]:
    """A tensor already made (raw bytes in host memory), handed to the writers piece by piece."""
    data = as_array(data)
    for first in range(0, data.size, piece_bytes):
        count = min(piece_bytes, data.size - first)
        yield Piece(first, count, source, 0, 0, _from_memory(data[first : first + count]))


def _transpose(tensor: PlannedTensor, reader: TensorReader, route) -> Iterator[Piece]:
    """A Conv1D layer's weight: dequantized whole as quantized, (out, in), then written transposed, (in, out).
    Memory: that weight twice, for each of the ``SHARDS_AT_ONCE`` shards written side by side."""
    import torch

    base = dataclasses.replace(tensor, recipe=tensor.recipe.base, shape=tuple(reversed(tensor.shape)))
    whole = _whole(base, reader, route).view(DTYPES[tensor.dtype].torch).view(base.shape)
    transposed = whole.T.contiguous().view(-1).view(torch.uint8)
    yield from _pieces_from_memory(transposed, tensor.recipe.sources[0], route.piece_bytes)


def _merge_lora(tensor: PlannedTensor, reader: TensorReader, route) -> Iterator[Piece]:
    """The base tensor made whole (a merge needs all of it), merged on the route's device as peft would there, then
    written from memory. On the GPU route the weight is made whole in device memory (``_whole`` on the device) and the
    result copied out through pinned memory: no round trip through pageable pages, which took 15x the merge's own
    time (benchmarks/bench_merge.py). Host memory: the merged weight (and on the CPU route about two fp32 copies
    while merging) for each of the ``SHARDS_AT_ONCE`` shards written side by side (1.9 GB of RSS at the peak on the
    8B-shaped benchmark)."""
    import torch

    recipe = tensor.recipe
    whole = _whole(dataclasses.replace(tensor, recipe=recipe.base), reader, route, route.device)
    base = whole.view(DTYPES[tensor.dtype].torch).view(tensor.shape).to(route.device)
    merged = peft_lora.merge(recipe.target, base, peft_lora.read_lora(recipe.target, reader), inplace=True)
    merged = merged.contiguous().view(-1).view(torch.uint8)
    if merged.is_cuda:  # out through pinned memory: several times faster than into fresh pageable pages
        merged = torch.empty(merged.numel(), dtype=torch.uint8, pin_memory=True).copy_(merged)
    yield from _pieces_from_memory(merged, recipe.sources[0], route.piece_bytes)


def _from_memory(data):
    def make(read, out):
        out[:] = data

    return make


# How each kind of recipe is made; verification.py holds the reference twin of this table.
PRODUCERS: dict[type, Callable[[PlannedTensor, TensorReader, object], Iterator[Piece]]] = {
    Copy: _copy,
    Dequantize4bit: _dequantize_4bit,
    Dequantize8bit: _dequantize_8bit,
    Transpose: _transpose,
    MergeLora: _merge_lora,
}


# --- routes: how pieces are made on a device ------------------------------------------------------------------


def _cast(source_dtype: str, target_dtype: str):
    """A plain tensor's piece cast on the CPU, on either route (so both give the same bits): kernels/cpu.cast."""

    def make(read, out):
        from .kernels import cpu

        cpu.cast(read, source_dtype, out, target_dtype)

    return make


class _Buffers:
    """Reused host buffers: uint8 numpy arrays, or pinned uint8 tensors for the pieces a GPU makes. A buffer given back
    with an event is taken again only once that event has passed (a copy may still be reading it); one whose event
    has passed is taken first."""

    def __init__(self, size: int, pinned: bool, slots=None, overflow: "_Buffers | None" = None):
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


class CpuRoute:
    """Pieces made on the CPU, spread over the cores. Casts run on the makers' threads; 4-bit and 8-bit pieces run
    in worker processes (workers.py) where the machine has ``PROCESS_MIN_CORES`` cores or more, else on the threads
    too. Pieces are numpy arrays, and 4-bit pieces and casts are made in numpy (kernels/cpu.py): torch is imported
    only by what needs it (_needs_torch: 8-bit pieces, LoRA merges, Conv1D transposes, fp16 out), and then runs one
    thread per maker (the makers are the parallelism; more would oversubscribe the cores)."""

    piece_bytes = CPU_PIECE_BYTES

    def __init__(self, workers: int | None = None, processes: int | None = None):
        """``processes``: worker processes (default: from the cores and NF4CONVERT_PROCESSES; 0 for none), with one
        maker thread each; ``workers``: maker threads where there are no worker processes (default: one per core,
        ``MAX_MAKERS`` at most)."""
        from . import workers as _workers
        from .devices import cpu_cores

        self.device = "cpu"
        cores = cpu_cores()  # a container's CPU quota counted
        if processes is None and PROCESSES is not None:
            processes = min(PROCESSES, cores)
        if processes is None:
            processes = min(cores // 2, MAX_PROCESSES) if cores >= PROCESS_MIN_CORES else 0
        self._workers = self._shared = None
        self._buffers = _Buffers(self.piece_bytes, pinned=False)
        if processes > 0 and _workers.usable():
            self._fork(processes)
        self.makers = self._workers.count if self._workers else workers or min(cores, MAX_MAKERS)
        self._threads = None  # torch's thread count here once torch is in use (None: it is not), restored at exit

    def _fork(self, processes: int) -> None:
        from . import workers as _workers

        slots = 2 * (READ_AHEAD + processes + WRITE_AHEAD + 2)  # a read and a made piece for each one in flight
        try:
            self._workers = _workers.Workers(processes, slots, self.piece_bytes)
        except OSError:  # no processes to be had (memory, a limit on their number): threads then
            self._workers = None
        self._shared = _Buffers(self.piece_bytes, False, self._workers, overflow=self._buffers) if self._workers else None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if self._workers is not None:
            self._workers.close()
        if self._threads is not None:
            import torch

            torch.set_num_threads(self._threads)

    def pool(self, piece: Piece) -> _Buffers:
        return self._shared if piece.on_device and self._shared is not None else self._buffers

    def warm(self, plan: Plan, reader: TensorReader) -> None:
        """Where the plan needs torch (_needs_torch), import it now (the makers and workers then run it on one thread
        each), and fork the workers again if they were forked without it: each would import it on its own (on the H200
        machine, fp16 out: 2.8 GB of memory with the workers, and the pipeline 3x slower), where forked now they share
        this process's pages of it."""
        had_torch = sys.modules.get("torch") is not None
        needs_torch = any(_needs_torch(tensor) for tensor in plan.tensors)
        if self._threads is None and (had_torch or needs_torch):  # torch in use: casts take it too (cpu.cast)
            import torch

            self._threads = torch.get_num_threads()
            if self._workers is not None and needs_torch and not had_torch:
                torch.set_num_threads(1)  # this thread's setting, which the workers forked from it take
                count = self._workers.count
                self._workers.close()
                self._fork(count)  # as many as the makers the pipeline has: on threads if no fork is to be had
                torch.set_num_threads(self._threads)  # this thread merges and transposes: on every core

    def maker_started(self) -> None:
        """torch on one thread in each maker thread (its setting is the thread's own), where torch is in use."""
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(1)

    def state_4bit(self, state):
        return state  # numpy arrays, as read

    def _made(self, function: Callable, *args) -> Callable:
        if self._workers is None:
            return lambda read, out: function(read, out, *args)
        return lambda read, out: self._workers.run(function, read, out, *args)

    def dequantize_4bit(self, state):
        return self._made(_dequantize_4bit_on_cpu, state)

    def dequantize_8bit(self, scb, columns: int, out_type):
        return self._made(_dequantize_8bit_on_cpu, scb, columns, out_type)


def _needs_torch(tensor: PlannedTensor) -> bool:
    """Whether the CPU route makes ``tensor`` with torch: anything but plain tensors and 4-bit weights (8-bit weights,
    LoRA merges, Conv1D transposes), and whatever it stores in a dtype that numpy converts slowly (cpu.uses_torch)."""
    from .kernels import cpu

    recipe = tensor.recipe
    if isinstance(recipe, Copy):
        return recipe.source.dtype != tensor.dtype and cpu.uses_torch(tensor.dtype)
    return not isinstance(recipe, Dequantize4bit) or cpu.uses_torch(tensor.dtype)


def _dequantize_4bit_on_cpu(packed, out, state) -> None:
    from .kernels import cpu

    nested = state.state2
    cpu.dequantize(packed, state.absmax, nested and nested.code, nested and nested.absmax, state.offset,
                   bnb4.CODES[state.quant_type], out, state.dtype, state.blocksize, nested.blocksize if nested else 0)  # fmt: skip


def _dequantize_8bit_on_cpu(codes, out, scb, columns: int, out_type) -> None:
    import torch

    rows = codes.size // columns
    made = bnb8.dequantize(torch.from_numpy(codes).view(torch.int8).view(rows, columns), scb, out_type)
    torch.from_numpy(out).view(out_type).view(rows, columns).copy_(made)


class _Slot:
    """Device buffers for one piece in flight, and the event after which they are free again."""

    def __init__(self, size: int, device):
        import torch

        self.packed = torch.empty(size, dtype=torch.uint8, device=device)
        self.out = torch.empty(size, dtype=torch.uint8, device=device)
        self.free = None
        self.keep = None  # a result the device-to-host copy still reads


class CudaRoute:
    """Pieces made on one GPU: one maker thread enqueues copies and kernels, nothing waits on the host but
    the writer (for its piece's event) and a reused pinned buffer (for the copy that last read it).

    The route starts on a thread of its own (CUDA's context, streams, device buffers, then a warm-up launch
    of the kernel for the plan's first 4-bit piece, which loads or compiles it), so plain tensors are read
    and written meanwhile; the first piece the GPU makes waits for it."""

    piece_bytes = CUDA_PIECE_BYTES
    makers = 1  # enqueues only; one thread keeps the streams' order simple
    slots = 3  # pieces on the device at once: one copied in, one made, one copied out

    def __init__(self, device):
        from concurrent.futures import ThreadPoolExecutor

        import torch

        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self._pinned = _Buffers(self.piece_bytes, pinned=True)  # pieces the GPU makes
        self._host = _Buffers(self.piece_bytes, pinned=False)  # pieces made (or only copied) on the CPU
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

    def pool(self, piece: Piece) -> _Buffers:
        return self._pinned if piece.on_device else self._host

    def warm(self, plan: Plan, reader: TensorReader) -> None:
        """Launch the kernel once, on the start thread, as the plan's first 4-bit piece will (its output thrown away;
        a failure here is the first real piece's to report)."""
        first = next((tensor for tensor in plan.tensors if isinstance(innermost(tensor.recipe), Dequantize4bit)), None)
        if first is not None:
            self._starter.submit(self._warm, dataclasses.replace(first, recipe=innermost(first.recipe)), reader)

    def _warm(self, tensor: PlannedTensor, reader: TensorReader) -> None:
        import torch

        self._ready.result()
        piece = next(_dequantize_4bit(tensor, reader, self))
        read = torch.zeros(piece.count, dtype=torch.uint8, pin_memory=True)
        out = torch.empty(piece.nbytes, dtype=torch.uint8, pin_memory=True)
        piece.make(read, out).synchronize()
        profile.mark("kernel warmed")

    def maker_started(self) -> None:
        import torch

        torch.cuda.set_device(self.device)

    def state_4bit(self, state):
        """The quant state as read (numpy) as the kernel takes it: tensors on this route's GPU."""
        return bnb4.on_device(state, self.device)

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

    def dequantize_4bit(self, state):
        from .dequantize import dequantize_4bit

        def compute(packed, out):
            dequantize_4bit(packed, state, out=out.view(state.dtype))
            return out

        return _DeviceMake(self, compute)

    def dequantize_8bit(self, scb, columns: int, out_type):
        import torch

        def compute(codes, out):
            rows = codes.numel() // columns
            return bnb8.dequantize(codes.view(torch.int8).view(rows, columns), scb, out_type).view(-1).view(torch.uint8)

        return _DeviceMake(self, compute)


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


def route_for(device):
    """The route that makes pieces on ``device`` (a torch.device, or "cpu": devices.pick_device); a CUDA route starts
    at once, in the background."""
    return CudaRoute(device) if getattr(device, "type", device) == "cuda" else CpuRoute()


# --- the pipeline -------------------------------------------------------------------------------------------------


class _Pipeline:
    """Pieces through read -> make -> write, in order of arrival, at most ``READ_AHEAD + makers + WRITE_AHEAD``
    in flight. The caller's thread moves each piece on when the stage before it is done, so a failure in any
    stage surfaces there (and stops everything) at the next step."""

    def __init__(self, route, reader: TensorReader, progress: Callable[[int], None]):
        from concurrent.futures import ThreadPoolExecutor

        self.route, self.reader, self.progress = route, reader, progress
        self._readers = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="nf4convert-read")
        self._makers = ThreadPoolExecutor(route.makers, thread_name_prefix="nf4convert-make",
                                          initializer=route.maker_started)  # fmt: skip
        self._writers = ThreadPoolExecutor(WRITERS, thread_name_prefix="nf4convert-write")
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
            profile.record(pipeline={"seconds": _now() - self._started, "pieces": self._pieces, "busy": self._busy,
                                     "waited": self._waited})  # fmt: skip
            self._started = None

    def _timed(self, stage: str, started: float) -> None:
        self._busy[stage] += _now() - started  # += on a float under the GIL: a lost update only blurs a profile

    def _read(self, piece: Piece):
        started = _now()
        buffer = self.route.pool(piece).take(piece.count)
        read = self.reader.read(piece.source, piece.first, piece.count, out=buffer)
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

    def _write(self, writer: ShardWriter, name: str, piece: Piece, made, event, buffer) -> None:
        started = _now()
        if event is not None:
            event.synchronize()
        writer.write(name, made, offset=piece.offset)
        if piece.watched and name not in self.infinite and _holds_inf(as_array(made)):
            self.infinite.add(name)
        self.route.pool(piece).give(buffer)
        self._timed("write", started)
        profile.mark("first piece written")

    def _result(self, stage: str, future):
        started = _now()
        result = future.result()
        self._waited[stage] += _now() - started
        return result

    def push(self, writer: ShardWriter, name: str, piece: Piece) -> None:
        self._pieces += 1
        self._reads.append((writer, name, piece, self._readers.submit(self._read, piece)))
        self._step(READ_AHEAD, self.route.makers, WRITE_AHEAD)

    def drain(self) -> None:
        self._step(0, 0, 0)

    def _step(self, reads: int, makes: int, writes: int) -> None:
        from concurrent.futures import Future

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


def _holds_inf(raw) -> bool:
    """Whether fp16 bytes (a uint8 numpy array) hold ±inf: the largest magnitude's bits first (one pass and a
    reduction), the elements only where that is inf or NaN (a NaN is larger: it hides them)."""
    import numpy as np

    magnitudes = np.bitwise_and(raw.view(np.uint16), 0x7FFF)
    return magnitudes.size > 0 and int(magnitudes.max()) >= 0x7C00 and bool((magnitudes == 0x7C00).any())


def _now() -> float:
    import time

    return time.perf_counter()


def _shard_pieces(writer: ShardWriter, shard, reader: TensorReader, route, tensor_done: Callable[[], None]):
    """(writer, tensor name, piece) for every piece of one shard, its plain tensors first."""
    plain = [tensor for tensor in shard.tensors if isinstance(tensor.recipe, Copy)]
    made = [tensor for tensor in shard.tensors if not isinstance(tensor.recipe, Copy)]
    for tensor in plain + made:
        watched = may_exceed(tensor)
        for piece in PRODUCERS[type(tensor.recipe)](tensor, reader, route):
            piece.watched = watched
            yield writer, tensor.name, piece
        tensor_done()


def _interleaved(streams: list) -> Iterator:
    """One item of each stream in turn until all are done."""
    streams = list(streams)
    while streams:
        for stream in list(streams):
            item = next(stream, None)
            if item is None:
                streams.remove(stream)
            else:
                yield item


def write_shards(plan: Plan, folder: Path, reader: TensorReader, device, *, progress: Callable[[int], None],
                 tensor_done: Callable[[int], None] = lambda done: None, route=None) -> list[str]:  # fmt: skip
    """Write every shard of ``plan`` into ``folder``, making each tensor by its recipe on ``device``
    (through ``route`` when given, closed here as one made here would be). Returns the names of the tensors written
    as fp16 with ±inf where their source may have held values beyond fp16's range (plan.may_exceed), in plan order."""
    done = 0

    def one_done() -> None:
        nonlocal done
        done += 1
        tensor_done(done)

    writeback = Writeback() if WRITEBACK else None
    try:
        with route or route_for(device) as route, _Pipeline(route, reader, progress) as pipeline:
            route.warm(plan, reader)
            writers: list[ShardWriter] = []
            try:
                for start in range(0, len(plan.shards), SHARDS_AT_ONCE):
                    group = plan.shards[start : start + SHARDS_AT_ONCE]
                    opened = []
                    for shard in group:
                        opened.append(ShardWriter(folder / shard.filename, shard.tensors, writeback))
                        writers.append(opened[-1])
                    streams = [_shard_pieces(writer, shard, reader, route, one_done) for writer, shard in zip(opened, group)]
                    for writer, name, piece in _interleaved(streams):
                        pipeline.push(writer, name, piece)
                    pipeline.drain()
                    for writer in opened:
                        writer.close()
            except BaseException:
                pipeline.close()  # no write may still be running when its file closes
                for writer in writers:
                    writer.discard()
                raise
            return [tensor.name for tensor in plan.tensors if tensor.name in pipeline.infinite]
    finally:
        if writeback is not None:
            writeback.close()
