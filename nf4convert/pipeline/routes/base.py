"""What every route answers, which is all that kinds and the pipeline ask of it, and the route for a device.

A route knows nothing of formats or kinds: a kind's ``produce`` cuts its tensor into pieces and gives each the
``make`` the route builds from the kind's own computations (``make(host, device)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Protocol

if TYPE_CHECKING:
    from ...safetensors_io.read import TensorInfo, TensorReader
    from ...settings import Settings
    from ..piece import Buffers, Piece


class Route(Protocol):
    """Where and how pieces are made (``cpu.CpuRoute``, ``cuda.CudaRoute``)."""

    device: object  # where pieces are made: "cpu", or a torch.device
    gpu: bool  # whether ``device`` is a GPU: a kind then moves what its device computation reads there
    piece_bytes: int  # a piece's largest output
    makers: int  # pieces made at once (the pipeline's maker threads)

    def pool(self, piece: Piece) -> Buffers:
        """The buffers ``piece`` is read and made into."""

    def warm(self, plan, reader: TensorReader) -> None:
        """Start what ``plan`` will need (torch, the GPU's context, the kernel)."""

    def maker_started(self) -> None:
        """Each maker thread's set-up."""

    def make(self, host: Callable | None, device: Callable | None = None) -> Callable:
        """A piece's ``make(read, out) -> event or None``, from a kind's computations of it.

        ``host(read, out)`` fills ``out`` from ``read`` (uint8 numpy arrays) on the CPU. It must pickle: a module-level
        function, wrapped in functools.partial with numpy arrays, ints and str. The CPU route runs it in a worker
        process where the piece's buffers lie in the workers' shared mapping (``Piece.on_device``), else on the maker
        thread; a GPU route runs it on the maker thread where the kind gives no ``device`` (None where it does: a
        kind computing on a GPU keeps what its computation reads there).

        ``device(device_in, device_out) -> result`` computes on a GPU route's device, from the piece's bytes copied
        there (``device_in``, uint8) into ``device_out`` (uint8, the piece's size) or a tensor of its own, and returns
        the result as uint8; the route copies it in and out through its slots and streams. Both give the same bytes.
        """

    def make_into(self, piece: Piece, read, target) -> None:
        """``piece`` made from ``read`` straight into ``target``: a tensor made whole (kinds/base.py: whole)."""

    def pieces_of(self, data, source: TensorInfo) -> Iterator[Piece]:
        """A tensor already made (raw bytes, in its memory) as pieces for the writers."""


def route_for(device, settings: Settings | None = None) -> Route:
    """The route that makes pieces on ``device`` (a torch.device, or "cpu": devices.pick_device); a CUDA route starts
    at once, in the background."""
    if getattr(device, "type", device) == "cuda":
        from .cuda import CudaRoute

        return CudaRoute(device)
    from .cpu import CpuRoute

    return CpuRoute(settings)
