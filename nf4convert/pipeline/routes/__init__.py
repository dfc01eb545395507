"""Routes: how pieces are made on a device. Every route answers the same few questions, which is all that kinds
and the pipeline ask of it:

    device, piece_bytes, makers          where it makes pieces, how large, how many at once
    pool(piece)                          the buffers a piece is read and made into
    warm(plan, reader)                   start what the plan will need (torch, the GPU's context, the kernel)
    maker_started()                      each maker thread's set-up
    cast(source_dtype, target_dtype)     -> make: a plain tensor's piece cast (on the CPU, on every route)
    state_4bit(state)                    a 4-bit quant state as this route's kernel takes it
    dequantize_4bit(state), dequantize_8bit(scb, columns, out_type) -> make
    make_into(piece, read, target)       one piece made straight into a tensor made whole
    pieces_of(data, source)              a tensor already made (raw bytes, in its memory) as pieces for the writers
"""

from __future__ import annotations

from ...settings import Settings


def route_for(device, settings: Settings | None = None):
    """The route that makes pieces on ``device`` (a torch.device, or "cpu": devices.pick_device); a CUDA route starts
    at once, in the background."""
    if getattr(device, "type", device) == "cuda":
        from .cuda import CudaRoute

        return CudaRoute(device)
    from .cpu import CpuRoute

    return CpuRoute(settings)
