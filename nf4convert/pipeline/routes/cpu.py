"""The CPU route: pieces made on the CPU, spread over the cores. Casts run on the makers' threads (one numpy call
each, which lets go of Python's lock); 4-bit and 8-bit pieces run in forked worker processes (``workers.py``; the
CPU kernel works on whole blocks, so any piece stands alone) where the machine has enough cores for them to pay.
"""

from __future__ import annotations

import sys
from typing import Callable, Iterator

from ...formats import bnb4, bnb8
from ...safetensors_io.read import TensorReader
from ...settings import Settings
from ..core import READ_AHEAD, WRITE_AHEAD
from ..piece import Buffers, Piece, pieces_from_memory

CPU_PIECE_BYTES = 1 << 22  # output bytes per piece: small, as every core holds one (and its fp32 scratch)
# Worker processes, one per two cores and at most MAX_PROCESSES, pay where there are PROCESS_MIN_CORES cores or more:
# the other half of the cores read, write and hand pieces over (more processes starve the writers).
PROCESS_MIN_CORES, MAX_PROCESSES = 8, 8


def cast(source_dtype: str, target_dtype: str):
    """A plain tensor's piece cast on the CPU, on either route (so both give the same bits): kernels/cpu.cast."""

    def make(read, out):
        from ...kernels import cpu

        cpu.cast(read, source_dtype, out, target_dtype)

    return make


class CpuRoute:
    """Pieces made on the CPU, spread over the cores. Casts run on the makers' threads; 4-bit and 8-bit pieces run
    in worker processes (workers.py) where the machine has ``PROCESS_MIN_CORES`` cores or more, else on the threads
    too. Pieces are numpy arrays, and 4-bit pieces and casts are made in numpy (kernels/cpu.py): torch is imported
    only by what needs it (_needs_torch: 8-bit pieces, LoRA merges, Conv1D transposes, fp16 out), and then runs one
    thread per maker (the makers are the parallelism; more would oversubscribe the cores)."""

    piece_bytes = CPU_PIECE_BYTES
    cast = staticmethod(cast)

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
        each), and fork the workers again if they were forked without it: each would import it on its own (gigabytes of
        memory with many workers, and a slower pipeline), where forked now they share this process's pages of it."""
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

    def make_into(self, piece: Piece, read, target) -> None:
        """Make ``piece`` from ``read`` into ``target`` (host tensors) on this thread: a tensor made whole."""
        piece.make(read.numpy(), target.numpy())

    def pieces_of(self, data, source) -> Iterator[Piece]:
        """A tensor already made in host memory (raw bytes), handed to the writers piece by piece."""
        return pieces_from_memory(data, source, self.piece_bytes)

    def dequantize_4bit(self, state):
        return self._made(_dequantize_4bit_on_cpu, state)

    def dequantize_8bit(self, scb, columns: int, out_type):
        return self._made(_dequantize_8bit_on_cpu, scb, columns, out_type)


def _needs_torch(tensor) -> bool:
    """Whether the CPU route makes ``tensor`` with torch: anything but plain tensors and 4-bit weights (8-bit weights,
    LoRA merges, Conv1D transposes), and whatever it stores in a dtype that numpy converts slowly (cpu.uses_torch)."""
    from ...kernels import cpu

    recipe = tensor.recipe
    return not recipe.numpy_made or (recipe.converts_to(tensor.dtype) and cpu.uses_torch(tensor.dtype))


def _dequantize_4bit_on_cpu(packed, out, state) -> None:
    from ...kernels import cpu

    nested = state.state2
    cpu.dequantize(
        packed,
        state.absmax,
        nested and nested.code,
        nested and nested.absmax,
        state.offset,
        bnb4.CODES[state.quant_type],
        out,
        state.dtype,
        state.blocksize,
        nested.blocksize if nested else 0,
    )


def _dequantize_8bit_on_cpu(codes, out, scb, columns: int, out_type) -> None:
    import torch

    rows = codes.size // columns
    made = bnb8.dequantize(torch.from_numpy(codes).view(torch.int8).view(rows, columns), scb, out_type)
    torch.from_numpy(out).view(out_type).view(rows, columns).copy_(made)
