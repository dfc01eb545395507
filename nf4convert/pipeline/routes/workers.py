"""The CPU route's worker processes: 4-bit and 8-bit pieces made outside this process's interpreter lock.

A thread decodes a piece in a few calls into numpy and torch; each call lets go of Python's lock and takes it back
when it returns. With many threads they wait on that lock more than they decode; worker processes do not, and on a
16-core machine took the CPU route's pipeline well past what threads reached (docs/performance.md). Too many starve
the readers and writers of cores (routes/cpu.py: one per two cores).

- The workers are forked when the route is made, from the thread that makes it, before the pipeline's threads
  start. They share what this process has imported (numpy, the CPU kernel): nothing to import again. torch is not
  among it unless this process had it: a worker imports it only for a piece that needs it (8-bit, fp16 out), and
  then runs it on one thread.
- Each piece's input and output bytes lie in one shared anonymous mapping made before the fork (fixed slots of one
  piece each, handed out by the route's buffer pool). The maker thread that hands a piece to a worker sends the two
  offsets and the piece's small arguments, and waits for the answer. Tensors among those arguments travel as numpy
  arrays: pickled as tensors, torch's pickler would move each into shared memory of its own. The pieces' bytes are
  numpy arrays on both sides.
- A piece whose bytes are not both in the mapping (no slot was free, or a piece larger than a slot) is made on the
  calling thread by the same function: the same bytes either way.
- Workers ignore Ctrl-C, SIGTERM and SIGHUP (errors.STOP_SIGNALS): this process takes them and stops the workers,
  also at exit when nobody closed them. A worker that dies (killed by the system) is a one-line error, for every
  piece waiting on one too; forking that fails leaves the route on threads.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
from typing import Callable

from ...errors import WorkerError

STOPPED = (
    "a worker process of the CPU route stopped (killed by the system: out of memory?); NF4CONVERT_PROCESSES=0 "
    "makes the pieces on threads instead"
)


def usable() -> bool:
    """Whether worker processes can be forked here (Linux; fork is unsafe or missing elsewhere)."""
    import multiprocessing

    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


class Workers:
    """``count`` forked worker processes, each answering one caller at a time over a pipe of its own, and a shared
    mapping of ``slots`` slots of ``slot_bytes`` each. (concurrent.futures' process pool spends a good part of a
    piece's decode per call in its queues and threads; a pipe per worker takes a few tens of microseconds.)"""

    def __init__(self, count: int, slots: int, slot_bytes: int):
        import mmap
        import multiprocessing
        import multiprocessing.util  # noqa: F401  (registers its exit handler, which must come before ours: below)
        import queue
        import signal
        import warnings

        import numpy as np

        from ...errors import STOP_SIGNALS
        from ...kernels import cpu  # noqa: F401  (imported here, so that no worker imports anything: see _serve)

        self.count, self._slots, self._slot_bytes = count, slots, slot_bytes
        mapping = mmap.mmap(-1, slots * slot_bytes)  # MAP_SHARED | MAP_ANONYMOUS: the children see its pages
        self._memory = np.frombuffer(mapping, dtype=np.uint8)  # the mapping lives as long as a view of it
        self._base, self._size = self._memory.ctypes.data, slots * slot_bytes
        self._handed = 0
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._all: list = []
        context = multiprocessing.get_context("fork")
        # Closed at exit if not before (also when a signal stops this constructor): multiprocessing's own exit handler
        # (registered earlier, when multiprocessing.util was imported above, so run later) would send them SIGTERM,
        # which they ignore, and wait for them forever. (torch imports it too; without torch it came only at the
        # first start(), after this registration, and an unclosed route hung the exit.)
        atexit.register(self.close)
        # A stop signal between a fork and the worker's ignoring it would run this process's handler in the child (a
        # traceback from it): they wait, blocked, until each fork is done, here and (until it ignores them) there.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            # Python 3.12+ warns on fork() beside other threads (tqdm's monitor, a finished run's side thread): the
            # workers take no lock those could hold (nothing to import, no allocation shared with them).
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*fork", category=DeprecationWarning)
                for _ in range(count):
                    ours, theirs = context.Pipe()
                    earlier = [end for _, end in self._all]
                    process = context.Process(
                        target=_serve,
                        args=(theirs, [ours, *earlier], mapping, blocked),
                        name="nf4convert-cpu-worker",
                        daemon=True,
                    )
                    process.start()
                    theirs.close()
                    self._all.append((process, ours))
                    self._idle.put((process, ours))
        except BaseException:
            self.close()
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def slot(self, nbytes: int):
        """A fresh slot of the mapping (uint8 numpy array of the slot's size), or None when ``nbytes`` does not fit one
        or every slot has been handed out. Slots are handed out once; the route's pool reuses them."""
        if nbytes > self._slot_bytes or self._handed == self._slots:
            return None
        first = self._handed * self._slot_bytes
        self._handed += 1
        return self._memory[first : first + self._slot_bytes]

    def holds(self, array) -> bool:
        """Whether the bytes of ``array`` (a numpy array) lie in the mapping."""
        return self._offset(array) is not None

    def _offset(self, array) -> int | None:
        offset = array.ctypes.data - self._base
        inside = array.flags.c_contiguous and 0 <= offset and offset + array.nbytes <= self._size
        return offset if inside else None

    def run(self, function: Callable, read, out, *args) -> None:
        """``function(read, out, *args)`` in an idle worker when both uint8 arrays lie in the mapping, else here. An
        exception it raises is raised here (as a RuntimeError with its text where it cannot travel)."""
        import pickle
        from multiprocessing.connection import wait

        read_at, out_at = self._offset(read), self._offset(out)
        if read_at is None or out_at is None:
            function(read, out, *args)
            return
        worker = self._idle.get()
        if worker is None:  # one has died: every caller, waiting or to come, fails as its caller did
            self._idle.put(None)
            raise WorkerError(STOPPED)
        process, pipe = worker
        alive = True
        try:
            pipe.send((function, read_at, read.nbytes, out_at, out.nbytes, _portable(args)))
            if pipe not in wait([pipe, process.sentinel]):  # the worker ended before it answered
                raise EOFError
            answer = pipe.recv_bytes()
        except (EOFError, OSError):
            alive = False
            raise WorkerError(STOPPED) from None
        finally:  # a job that could not be sent leaves the worker as it was
            self._idle.put(worker if alive else None)
        failure = pickle.loads(answer)
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
            process.close()  # its sentinel's descriptor
            pipe.close()
        self._all.clear()


# --- in the workers --------------------------------------------------------------------------------------------------


def _serve(pipe, inherited: list, mapping, mask) -> None:
    """A worker's life: make what each message asks, answer None or the exception it raised; stop on None or when the
    parent has gone (its end of the pipe closed: this process holds no copy of it, nor of another worker's)."""
    import os
    import pickle
    import signal

    import numpy as np

    from ...errors import STOP_SIGNALS
    from ...kernels import cpu

    for signum in STOP_SIGNALS:  # the parent's handlers came with the fork; the parent stops the workers
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # blocked by the parent around the fork
    for end in inherited:  # this worker's parent end, and the earlier workers' (forked along): not ours to hold
        end.close()
    one_thread = _one_torch_thread()  # the processes are the parallelism
    cpu.CHUNK_BYTES = cpu.PROCESS_CHUNK_BYTES  # no interpreter lock to share: chunks that stay in the L2 cache
    memory = np.frombuffer(mapping, dtype=np.uint8)
    parent = os.getppid()
    while True:
        try:
            while not pipe.poll(1.0):  # a parent killed outright closes its end; this is for one that hangs dying
                if os.getppid() != parent:
                    return
            job = pipe.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        function, read_at, read_count, out_at, out_count, args = job
        try:
            args = _restored(args)  # may import torch (tensors among the arguments), as may an earlier piece (fp16)
            one_thread = one_thread or _one_torch_thread()
            function(memory[read_at : read_at + read_count], memory[out_at : out_at + out_count], *args)
            answer = pickle.dumps(None)
        except BaseException as error:  # noqa: BLE001  (handed to the caller, who raises it)
            try:
                answer = pickle.dumps(error)
                pickle.loads(answer)  # one that pickles but cannot be rebuilt (an __init__ of other arguments) too
            except Exception:  # noqa: BLE001
                answer = pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))
        try:
            pipe.send_bytes(answer)
        except OSError:  # the parent has gone
            return


def _one_torch_thread() -> bool:
    """In a worker: torch on one thread once this process has it (the processes are the parallelism); whether it has."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    return torch is not None


# --- arguments across the pipe -----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Tensor:
    """A CPU tensor's bytes as a numpy array, with its dtype and shape."""

    data: object
    dtype: object
    shape: tuple


def _portable(value):
    """``value`` with every tensor in it (in tuples and dataclasses too) as a :class:`_Tensor`."""
    if sys.modules.get("torch") is None:  # no tensor can be among them
        return value
    import torch

    def leaf(tensor):
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.contiguous()
            return _Tensor(tensor.view(-1).view(torch.uint8).numpy(), tensor.dtype, tuple(tensor.shape))

    return _rebuilt(value, leaf)


def _restored(value):
    """The inverse of :func:`_portable`: every :class:`_Tensor` a tensor again (on the same bytes)."""

    def leaf(carried):
        if isinstance(carried, _Tensor):
            import torch

            return torch.from_numpy(carried.data).view(carried.dtype).view(carried.shape)

    return _rebuilt(value, leaf)


def _rebuilt(value, leaf):
    """``value`` with ``leaf(item)`` in place of each item for which it is not None, through tuples (not torch.Size,
    a tuple of ints that stays as it is) and dataclass instances (their init fields)."""
    replaced = leaf(value)
    if replaced is not None:
        return replaced
    if type(value) is tuple:
        return tuple(_rebuilt(item, leaf) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _rebuilt(getattr(value, f.name), leaf) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **fields)
    return value
