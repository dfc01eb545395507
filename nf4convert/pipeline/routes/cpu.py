"""The CPU route: pieces made on the CPU, spread over the cores. Pieces made in the makers' own buffers (casts: one
numpy call each, which lets go of Python's lock) run on the makers' threads; pieces made in the workers' shared
mapping (``Piece.on_device``: 4-bit and 8-bit pieces, each standing alone) run in forked worker processes
(``workers.py``) where the machine has enough cores for them to pay.
"""

from __future__ import annotations

import sys
from typing import Callable, Iterator

from ...safetensors_io.read import TensorReader
from ...settings import Settings
from ..core import READ_AHEAD, WRITE_AHEAD
from ..piece import Buffers, Piece, pieces_from_memory

CPU_PIECE_BYTES = 1 << 22  # output bytes per piece: small, as every core holds one (and its fp32 scratch)
# Worker processes, one per two cores and at most MAX_PROCESSES, pay where there are PROCESS_MIN_CORES cores or more:
# the other half of the cores read, write and hand pieces over (more processes starve the writers).
PROCESS_MIN_CORES, MAX_PROCESSES = 8, 8


class CpuRoute:
    """Pieces made on the CPU, spread over the cores (``base.Route`` says what a route answers). Casts run on the
    makers' threads; 4-bit and 8-bit pieces run in worker processes (workers.py) where the machine has
    ``PROCESS_MIN_CORES`` cores or more, else on the threads too. Pieces are numpy arrays, and 4-bit pieces and casts
    are made in numpy (kernels/cpu.py): torch is imported only by what needs it (_needs_torch: 8-bit pieces, LoRA
    merges, Conv1D transposes, fp16 out), and then runs one thread per maker (the makers are the parallelism; more
    would oversubscribe the cores)."""

    piece_bytes = CPU_PIECE_BYTES
    gpu = False

    def __init__(self, settings: Settings | None = None, *, workers: int | None = None, processes: int | None = None):
        """``processes``: worker processes (default: from the cores and ``settings.processes``; 0 for none), with one
        maker thread each; ``workers``: maker threads where there are no worker processes (default: one per core,
        ``settings.makers`` at most)."""
        from ...devices import cpu_cores
        from . import workers as _workers

        settings = settings or Settings()
        self.device = "cpu"
        cores = cpu_cores()  # a container's CPU quota counted
        if processes is None and settings.processes is not None:
            processes = min(settings.processes, cores)
        if processes is None:
            processes = min(cores // 2, MAX_PROCESSES) if cores >= PROCESS_MIN_CORES else 0
        self._workers = self._shared = None
        self._buffers = Buffers(self.piece_bytes, pinned=False)
        if processes > 0 and _workers.usable():
            self._fork(processes)
        self.makers = self._workers.count if self._workers else workers or min(cores, settings.makers)
        self._threads = None  # torch's thread count here once torch is in use (None: it is not), restored at exit

    def _fork(self, processes: int) -> None:
        from . import workers as _workers

        slots = 2 * (READ_AHEAD + processes + WRITE_AHEAD + 2)  # a read and a made piece for each one in flight
        self._forked_with_torch = sys.modules.get("torch") is not None
        try:
            self._workers = _workers.Workers(processes, slots, self.piece_bytes)
        except OSError:  # no processes to be had (memory, a limit on their number): threads then
            self._workers = None
        self._shared = (
            Buffers(self.piece_bytes, False, self._workers, overflow=self._buffers) if self._workers else None
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if self._workers is not None:
            self._workers.close()
        if self._threads is not None:
            import torch

            torch.set_num_threads(self._threads)

    def pool(self, piece: Piece) -> Buffers:
        return self._shared if piece.on_device and self._shared is not None else self._buffers

    def warm(self, plan, reader: TensorReader) -> None:
        """Where the plan needs torch (_needs_torch), import it now (the makers and workers then run it on one thread
        each), and fork the workers again if they were forked without it (planning may have imported it since): each
        would import it on its own (gigabytes of memory with many workers, and a slower pipeline), where forked now
        they share this process's pages of it."""
        had_torch = sys.modules.get("torch") is not None
        needs_torch = any(_needs_torch(tensor) for tensor in plan.tensors)
        if self._threads is None and (had_torch or needs_torch):  # torch in use: casts take it too (cpu.cast)
            import torch

            self._threads = torch.get_num_threads()
            if self._workers is not None and needs_torch and not self._forked_with_torch:
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

    def make(self, host: Callable, device: Callable | None = None) -> Callable:
        """``host(read, out)`` in a worker process where both lie in the shared mapping, else on the calling thread
        (``device`` is a GPU's: not here)."""
        if self._workers is None:
            return host
        return lambda read, out: self._run(host, read, out)

    def _run(self, host: Callable, read, out) -> None:
        workers = self._workers  # as they are now (warm may have forked them again)
        if workers is None:
            host(read, out)
        else:
            workers.run(host, read, out)

    def make_into(self, piece: Piece, read, target) -> None:
        """Make ``piece`` from ``read`` into ``target`` (host tensors) on this thread: a tensor made whole."""
        piece.make(read.numpy(), target.numpy())

    def pieces_of(self, data, source) -> Iterator[Piece]:
        """A tensor already made in host memory (raw bytes), handed to the writers piece by piece."""
        return pieces_from_memory(data, source, self.piece_bytes)


def _needs_torch(tensor) -> bool:
    """Whether the CPU route makes ``tensor`` with torch: anything but plain tensors and 4-bit weights (8-bit weights,
    LoRA merges, Conv1D transposes), and whatever it stores in a dtype that numpy converts slowly (cpu.uses_torch)."""
    from ...kernels import cpu

    recipe = tensor.recipe
    return not recipe.numpy_made or (recipe.converts_to(tensor.dtype) and cpu.uses_torch(tensor.dtype))
