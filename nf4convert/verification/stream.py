"""Verify's tensors streamed as the conversion streams them: each output tensor's reference is recomputed a slice at a
time (``reference/``: whole quant blocks, whole 8-bit rows, runs of plain elements; a merge or a transpose whole), on
a few threads, and each slice is compared with the same bytes of the output, read by positional reads, then dropped.
One thread's reads overlap the others' compute, and memory is a few slices whatever the model.

On a GPU the references are computed there and the output's bytes are copied to it (through pinned buffers, on each
thread's own stream) to be compared. On the CPU each thread runs torch on one core: the threads, not torch's own,
share the cores (torch's setting is restored after).
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

from ..devices import cpu_cores
from ..dtypes import DTYPES
from ..errors import CheckpointError
from .compare import Tallies, differing
from .reference.base import against

CPU_SLICE_BYTES = 1 << 23  # output bytes a CPU thread recomputes at once: its buffers reused, slice after slice
CUDA_SLICE_BYTES = 1 << 25  # on a GPU: larger copies, fewer launches
COMPARE_BYTES = 1 << 22  # output bytes read and compared at a time (a whole tensor's reference is compared in these)
CUDA_THREADS = 4  # enough reads in flight to keep the copies and the GPU busy
# On the CPU: one per core up to this. Each thread holds Python's lock between its numpy and torch calls, and its
# slice's buffers: past this many, threads waited on the lock more than they added, in more memory.
MAX_THREADS = 8


def _on_gpu(device) -> bool:
    return getattr(device, "type", device) == "cuda"  # a torch.device, or "cpu" (devices.pick_device)


def threads_for(device) -> int:
    return CUDA_THREADS if _on_gpu(device) else max(1, min(MAX_THREADS, cpu_cores()))


class _Buffers:
    """One thread's reused read buffers (pinned where a GPU copies from them): taken in turn, all free at ``reset``."""

    def __init__(self, pinned: bool):
        self._pinned = pinned
        self._held: list = []
        self._next = 0

    def reset(self) -> None:
        self._next = 0

    def take(self, nbytes: int):
        import torch

        if self._next == len(self._held):
            self._held.append(None)
        buffer = self._held[self._next]
        if buffer is None or buffer.numel() < nbytes:
            self._held[self._next] = None  # freed before its successor is made
            buffer = self._held[self._next] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pinned)
        self._next += 1
        return buffer[:nbytes]

    def reading(self, reader):
        """``read(info, first, count)`` for a reference: the bytes land in this thread's buffers."""
        return lambda info, first, count: reader.read(info, first, count, out=self.take(count))


def check_tensors(pairs, source_reader, output_reader, device, context, tallies: Tallies, advance) -> None:
    """Compare each ``(planned tensor, output TensorInfo)`` of ``pairs`` (same dtype and shape) with its reference on
    ``device``; mismatches and references that could not be computed go in ``tallies``; ``advance(nbytes)`` as bytes
    are compared. A file that cannot be read raises CheckpointError (from whichever thread met it)."""
    import torch

    cuda = _on_gpu(device)
    slice_bytes = CUDA_SLICE_BYTES if cuda else CPU_SLICE_BYTES
    count = threads_for(device)
    local = threading.local()
    stop = threading.Event()
    errors: list[BaseException] = []
    whole = threading.Lock()  # one reference of a whole tensor at a time: one tensor held, not one per thread
    slots = threading.BoundedSemaphore(2 * count)  # slices queued or running: the next ones' reads start at once
    progress = threading.Lock()
    torch_threads = torch.get_num_threads()

    def started():
        torch.set_num_threads(1)  # this thread's torch on one core: the threads share the cores
        local.stream = torch.cuda.Stream(device) if cuda else None
        local.source, local.output = _Buffers(pinned=cuda), _Buffers(pinned=cuda)
        local.made = _Buffers(pinned=False)

    def check(name, info, piece, itemsize, merged):
        try:
            if stop.is_set():
                return
            with whole if piece.nbytes > slice_bytes else contextlib.nullcontext():
                with torch.cuda.stream(local.stream) if cuda else contextlib.nullcontext():
                    _compare(name, info, piece, itemsize, merged)
        except BaseException as error:  # noqa: BLE001  (a file unreadable, or worse: raised from the caller's thread)
            errors.append(error)
            stop.set()
        finally:
            slots.release()

    def _compare(name, info, piece, itemsize, merged):
        local.source.reset()
        local.made.reset()
        try:
            expected = piece.make(local.source.reading(source_reader), local.made.take)
            if expected.numel() != piece.nbytes:
                raise ValueError(f"{expected.numel()} bytes computed where the output has {piece.nbytes}")
        except CheckpointError:
            raise
        except Exception as error:  # noqa: BLE001  (the reference library refused this input: a finding)
            tallies.fail(name, error)
            moved(piece.nbytes)
            return
        if merged is not None:  # a merge's NaN and ±inf: the report says which the base lacks (finite.py)
            tallies.count_non_finite(name, int((~torch.isfinite(expected.view(merged))).sum()))
        for start in range(0, piece.nbytes, COMPARE_BYTES):
            size = min(COMPARE_BYTES, piece.nbytes - start)
            local.output.reset()
            got = output_reader.read(info, piece.offset + start, size, out=local.output.take(size))
            tallies.add(name, differing(expected[start : start + size], got, itemsize), size)
            moved(size)

    def moved(nbytes):
        with progress:
            advance(nbytes)

    pool = ThreadPoolExecutor(count, thread_name_prefix="verify", initializer=started)
    try:
        for tensor, info in pairs:
            if stop.is_set():
                break
            itemsize = DTYPES[tensor.dtype].itemsize
            merged = DTYPES[tensor.dtype].torch if tensor.recipe.merges_adapter else None
            tallies.start(tensor.name, tensor.nbytes, itemsize, against(tensor, device))
            queued = 0
            try:
                for piece in context.slices(tensor, source_reader, device, slice_bytes):
                    slots.acquire()
                    if stop.is_set():
                        slots.release()
                        break
                    pool.submit(check, tensor.name, info, piece, itemsize, merged)
                    queued += piece.nbytes
            except CheckpointError:
                raise
            except Exception as error:  # noqa: BLE001  (the reference library refused the tensor's state: a finding)
                tallies.fail(tensor.name, error)
                moved(tensor.nbytes - queued)
    except BaseException:
        stop.set()  # the slices queued return at once
        raise
    finally:
        pool.shutdown(wait=True)
        torch.set_num_threads(torch_threads)
    if errors:
        raise errors[0]
