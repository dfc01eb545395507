"""``dequantize_4bit``: a bit-exact drop-in for ``bitsandbytes.functional.dequantize_4bit``."""

from __future__ import annotations

import math
import os
import weakref
from typing import Any, Optional

import torch

from .quant_state import BLOCKSIZES, CODES, OUT_DTYPES, canonical_code, check_sizes

BACKENDS = ("auto", "triton", "cpu")

# Repeat launches: id(quant_state) -> (what the launch was made from, replay). Dequantizing the same
# weight again (every forward pass of a QLoRA layer) then skips argument checks and Triton's Python
# launch path. Weak references prove the quant state and its tensors are the very ones of the launch.
_replays: dict = {}
_kernel_module = None  # nf4convert.kernels.nf4 once the kernel has run: its CONFIG_OVERRIDE is part of a replay


def _replay_key(packed, quant_state):
    nested = quant_state.state2
    return (
        packed.data_ptr(), packed.numel(), packed.device, tuple(quant_state.shape), quant_state.dtype,
        quant_state.blocksize, quant_state.quant_type,
        quant_state.absmax, nested and nested.absmax, nested and nested.code, nested and quant_state.offset,
    )  # fmt: skip


def _same(key, refs, packed, quant_state):
    nested = quant_state.state2
    return (
        key[0] == packed.data_ptr() and key[1] == packed.numel() and key[3] == quant_state.shape
        and key[4] is quant_state.dtype and key[5] == quant_state.blocksize and key[6] == quant_state.quant_type
        and refs[0]() is quant_state.absmax
        and (nested is None or (refs[1]() is nested.absmax and refs[2]() is nested.code and refs[3]() is quant_state.offset))
    )  # fmt: skip


def _remember(packed, quant_state, replay):
    key = _replay_key(packed, quant_state)
    state_id = id(quant_state)
    try:
        refs = tuple(weakref.ref(t) if isinstance(t, torch.Tensor) else (lambda: None) for t in key[7:])
        if state_id not in _replays:  # an entry under this id means this very object is alive: one finalizer
            weakref.finalize(quant_state, _replays.pop, state_id, None)
    except TypeError:  # an object that takes no weak references: no replays for it
        return
    _replays[state_id] = (key[:7], refs, replay, _kernel_module.CONFIG_OVERRIDE)


def _fields(packed: torch.Tensor, quant_state: Any, out: Optional[torch.Tensor], backend: str):
    """Check the arguments; return the kernel's inputs: (absmax, code2, absmax2, offset, code, nested blocksize)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    if quant_state.quant_type not in CODES:
        raise ValueError(f"quant_type must be 'nf4' or 'fp4', not {quant_state.quant_type!r}")
    if quant_state.dtype not in OUT_DTYPES.values():
        raise ValueError(f"dtype must be float16, bfloat16 or float32, not {quant_state.dtype}")
    if quant_state.blocksize not in BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {BLOCKSIZES}, not {quant_state.blocksize!r}")
    if not isinstance(packed, torch.Tensor):
        raise ValueError(f"packed must be a tensor, not {type(packed).__name__}")
    if not packed.is_contiguous():
        raise ValueError("packed must be contiguous")
    check_sizes(packed.numel() * packed.element_size(), quant_state, name="packed")
    device = packed.device
    absmax = quant_state.absmax
    code2 = absmax2 = offset = None
    nested_blocksize = 0
    if quant_state.nested:
        state2 = quant_state.state2
        nested_blocksize = int(state2.blocksize)
        if nested_blocksize <= 0 or nested_blocksize & (nested_blocksize - 1):
            raise ValueError(f"nested blocksize must be a power of two, not {nested_blocksize}")
        code2 = state2.code.to(device, torch.float32).contiguous()
        absmax2 = state2.absmax.to(device, torch.float32).contiguous()
        offset = quant_state.offset
        if not isinstance(offset, torch.Tensor):
            offset = torch.tensor(float(offset), dtype=torch.float32)
        offset = offset.to(device, torch.float32)
        absmax = absmax.to(device).contiguous()
    elif absmax.dtype != torch.float32 or absmax.device != device or not absmax.is_contiguous():
        absmax = absmax.to(device, torch.float32).contiguous()
    if out is not None:
        if out.dtype != quant_state.dtype:
            raise ValueError(f"out has dtype {out.dtype}, the quant state's is {quant_state.dtype}")
        if out.numel() != math.prod(quant_state.shape):
            raise ValueError(f"out has {out.numel()} elements, shape {tuple(quant_state.shape)} needs {math.prod(quant_state.shape)}")
        if out.device != device or not out.is_contiguous():
            raise ValueError(f"out must be contiguous on {device}")
    return absmax, code2, absmax2, offset, canonical_code(quant_state.quant_type, device), nested_blocksize


def _pick_backend(backend: str, device: torch.device) -> str:
    # Triton is imported only when the kernel runs: the CPU path never pays for it.
    if backend == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"backend='cpu' needs CPU tensors, not {device.type} tensors")
    return backend


def dequantize_4bit(
    packed: torch.Tensor,
    quant_state: Any = None,
    *,
    out: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Dequantize a bitsandbytes 4-bit weight, bit for bit what bitsandbytes' CUDA kernels give.

    Args:
        packed: the packed weight (``Params4bit`` data, any storage dtype, read as bytes), or a
            ``bitsandbytes.nn.Params4bit`` with ``quant_state=None``.
        quant_state: a bitsandbytes ``QuantState`` or :class:`nf4convert.QuantState4bit`.
        out: optional contiguous tensor of ``quant_state.dtype`` with ``prod(quant_state.shape)`` elements.
        backend: ``"triton"`` (the fused kernel: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1),
            ``"cpu"`` (the exact CPU path) or ``"auto"`` (Triton on CUDA, else CPU).

    Returns:
        A tensor of ``quant_state.shape`` and ``quant_state.dtype`` (``out`` reshaped, when given).

    Example:
        >>> import bitsandbytes.functional as F
        >>> packed, state = F.quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
        >>> dense = nf4convert.dequantize_4bit(packed, state)   # == F.dequantize_4bit(packed, state)
    """
    global _kernel_module
    if not torch.compiler.is_compiling() and out is None and (backend == "auto" or backend == "triton"):
        entry = _replays.get(id(quant_state if quant_state is not None else getattr(packed, "quant_state", None)))
        if entry is not None:
            if quant_state is None:
                quant_state = packed.quant_state
            if type(packed) is not torch.Tensor and isinstance(packed, torch.nn.Parameter):
                packed = packed.data
            key, refs, replay, config = entry
            if config is _kernel_module.CONFIG_OVERRIDE and _same(key, refs, packed, quant_state):
                result = torch.empty(key[3], dtype=key[4], device=key[2])
                if replay(result):
                    return result
    if quant_state is None:
        quant_state = getattr(packed, "quant_state", None)
        if quant_state is None:
            raise ValueError("quant_state is required unless packed is a bitsandbytes Params4bit")
    if isinstance(packed, torch.nn.Parameter):
        packed = packed.data
    absmax, code2, absmax2, offset, code, nested_blocksize = _fields(packed, quant_state, out, backend)
    shape = tuple(quant_state.shape)

    if torch.compiler.is_compiling():
        from .kernels import nf4  # noqa: F401, PLC0415  (registers the op)

        result = torch.ops.nf4convert.dequantize_4bit(
            packed, absmax, code2, absmax2, offset, code, quant_state.blocksize, nested_blocksize,
            list(shape), quant_state.dtype,
        )  # fmt: skip
        if out is None:
            return result
        out.copy_(result.view(out.shape))
        return out.view(shape)

    backend = _pick_backend(backend, packed.device)
    if out is None:
        out = torch.empty(shape, dtype=quant_state.dtype, device=packed.device)
    if backend == "cpu":
        from .kernels import cpu  # noqa: PLC0415

        cpu.dequantize(packed.view(torch.uint8).view(-1), absmax, code2, absmax2, offset, code, out,
                       quant_state.blocksize, nested_blocksize)  # fmt: skip
    else:
        from .kernels import nf4  # noqa: PLC0415

        _kernel_module = nf4
        replay = nf4.launch(packed, absmax, code2, absmax2, offset, code, out, quant_state.blocksize, nested_blocksize)
        # Only launches that read the quant state's own tensors (no converted copies) can be replayed.
        if replay is not None and absmax is quant_state.absmax and (
            code2 is None or (code2 is quant_state.state2.code and absmax2 is quant_state.state2.absmax and offset is quant_state.offset)
        ):  # fmt: skip
            _remember(packed, quant_state, replay)
    return out.view(shape)
