"""The CPU route's worker processes: 4-bit and 8-bit pieces made outside this process's interpreter lock.

A thread decodes a piece in a few calls into numpy and torch; each call lets go of Python's lock and takes it back
when it returns. With many threads they wait on that lock more than they decode. On the H200 machine's 16 cores
the 8B-shaped conversion's pipeline (benchmarks/bench_convert.py) took 6.7-6.9 s with 8 threads and 4.2-4.3 s with
8 worker processes; 12 processes starved the writers of cores (11.6 s). Logs: results-h200-convert-processes- and
results-h200-cpu-scaling-v2-2026-11-24.log.

- The workers are forked when the route is made, from the thread that makes it, before the pipeline's threads
  start. They share what this process has imported (torch, numpy): nothing to import again.
- Each piece's input and output bytes lie in one shared anonymous mapping made before the fork (fixed slots of one
  piece each, handed out by the route's buffer pool). The maker thread that hands a piece to a worker sends the two
  offsets and the piece's small arguments, and waits for the answer. Tensors among those arguments travel as numpy
  arrays: pickled as tensors, torch's pickler would move each into shared memory of its own.
- A piece whose bytes are not both in the mapping (no slot was free, or a piece larger than a slot) is made on the
  calling thread by the same function: the same bytes either way.
- Workers ignore Ctrl-C, SIGTERM and SIGHUP (output.STOP_SIGNALS): this process takes them and stops the workers,
  also at exit when nobody closed them. A worker that dies (killed by the system) is a one-line error, for every
  piece waiting on one too; forking that fails leaves the route on threads.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
from typing import Callable

from .errors import Nf4ConvertError

STOPPED = ("a worker process of the CPU route stopped (killed by the system: out of memory?); NF4CONVERT_PROCESSES=0 "
           "makes the pieces on threads instead")
_shared = None  # the mapping the workers being forked inherit (set before the forks)


def usable() -> bool:
    """Whether worker processes can be forked here (Linux; fork is unsafe or missing elsewhere)."""
    import multiprocessing

    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


class Workers:
    """``count`` forked worker processes, each answering one caller at a time over a pipe of its own, and a shared
    mapping of ``slots`` slots of ``slot_bytes`` each. (concurrent.futures' process pool took 0.5 ms a call through
    its queues and threads, a fifth of a piece's decode; a pipe per worker takes a few tens of microseconds.)"""

    def __init__(self, count: int, slots: int, slot_bytes: int):
        import mmap
        import multiprocessing
        import queue
        import warnings

        import torch

        global _shared
        self.count, self._slots, self._slot_bytes = count, slots, slot_bytes
        self._mapping = mmap.mmap(-1, slots * slot_bytes)  # MAP_SHARED | MAP_ANONYMOUS: the children see its pages
        self._memory = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self._base = self._memory.data_ptr()
        self._handed = 0
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._all: list = []
        _shared = self._mapping
        context = multiprocessing.get_context("fork")
        try:
            with warnings.catch_warnings():  # Python 3.12+ warns on fork() beside other threads; none of them runs here
                warnings.filterwarnings("ignore", message=".*fork", category=DeprecationWarning)
                for _ in range(count):
                    ours, theirs = context.Pipe()
                    process = context.Process(target=_serve, args=(theirs, [end for _, end in self._all]),
                                              name="nf4convert-cpu-worker", daemon=True)  # fmt: skip
                    process.start()
                    theirs.close()
                    self._all.append((process, ours))
                    self._idle.put((process, ours))
        except BaseException:
            self.close()
            raise
        # Closed at exit if not before: multiprocessing's own exit handler (registered earlier, so run later) would
        # send them SIGTERM, which they ignore, and wait for them forever.
        atexit.register(self.close)

    def slot(self, nbytes: int):
        """A fresh slot of the mapping (uint8 tensor of the slot's size), or None when ``nbytes`` does not fit one or
        every slot has been handed out. Slots are handed out once; the route's pool reuses them."""
        if nbytes > self._slot_bytes or self._handed == self._slots:
            return None
        first = self._handed * self._slot_bytes
        self._handed += 1
        return self._memory[first : first + self._slot_bytes]

    def _offset(self, tensor) -> int | None:
        offset = tensor.data_ptr() - self._base
        inside = tensor.is_contiguous() and 0 <= offset and offset + tensor.numel() * tensor.element_size() <= len(self._mapping)
        return offset if inside else None

    def run(self, function: Callable, read, out, *args) -> None:
        """``function(read, out, *args)`` in an idle worker when both byte tensors lie in the mapping, else here."""
        from multiprocessing.connection import wait

        read_at, out_at = self._offset(read), self._offset(out)
        if read_at is None or out_at is None:
            function(read, out, *args)
            return
        worker = self._idle.get()
        if worker is None:  # one has died: every caller, waiting or to come, fails as its caller did
            self._idle.put(None)
            raise Nf4ConvertError(STOPPED)
        process, pipe = worker
        try:
            pipe.send((function, read_at, read.numel(), out_at, out.numel(), _portable(args)))
            if pipe not in wait([pipe, process.sentinel]):  # the worker ended before it answered
                raise EOFError
            failure = pipe.recv()
        except (EOFError, OSError):
            self._idle.put(None)
            raise Nf4ConvertError(STOPPED) from None
        self._idle.put(worker)
        if failure is not None:
            raise failure

    def close(self) -> None:
        """Stop the workers (none is making a piece by now: the pipeline has stopped its makers)."""
        atexit.unregister(self.close)
        for process, pipe in self._all:
            try:
                pipe.send(None)
            except OSError:  # already gone
                pass
        for process, pipe in self._all:
            process.join(timeout=5)
            if process.exitcode is None:
                process.kill()
                process.join()
            pipe.close()
        self._all.clear()


# --- in the workers --------------------------------------------------------------------------------------------------


def _serve(pipe, inherited: list) -> None:
    """A worker's life: make what each message asks, answer None or the exception it raised; stop on None or when the
    parent has gone."""
    import signal

    import torch

    from .kernels import cpu
    from .output import STOP_SIGNALS

    for signum in STOP_SIGNALS:  # the parent's handlers came with the fork; the parent stops the workers
        signal.signal(signum, signal.SIG_IGN)
    for end in inherited:  # the other workers' pipes (their ends in the parent, forked with it): not ours to hold
        end.close()
    torch.set_num_threads(1)  # the processes are the parallelism
    cpu.CHUNK_BYTES = cpu.PROCESS_CHUNK_BYTES  # no interpreter lock to share: chunks that stay in the L2 cache
    memory = torch.frombuffer(_shared, dtype=torch.uint8)
    while True:
        try:
            job = pipe.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        function, read_at, read_count, out_at, out_count, args = job
        try:
            function(memory[read_at : read_at + read_count], memory[out_at : out_at + out_count], *_restored(args))
            answer = None
        except BaseException as error:  # noqa: BLE001  (handed to the caller, who raises it)
            answer = error
        try:
            pipe.send(answer)
        except Exception:  # an exception that cannot be pickled: its text
            pipe.send(RuntimeError(f"{type(answer).__name__}: {answer}"))


# --- arguments across the pipe -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Tensor:
    """A CPU tensor's bytes as a numpy array, with its dtype and shape."""

    data: object
    dtype: object
    shape: tuple


def _portable(value):
    import torch

    if isinstance(value, torch.Tensor):
        tensor = value.contiguous()
        return _Tensor(tensor.view(-1).view(torch.uint8).numpy(), tensor.dtype, tuple(tensor.shape))
    if type(value) is tuple:  # not torch.Size, a tuple of ints that stays as it is
        return tuple(_portable(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _portable(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    return value


def _restored(value):
    import torch

    if isinstance(value, _Tensor):
        return torch.from_numpy(value.data).view(value.dtype).view(value.shape)
    if type(value) is tuple:
        return tuple(_restored(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: _restored(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **changes)
    return value
