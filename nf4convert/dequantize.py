"""``dequantize_4bit``: a bit-exact drop-in for ``bitsandbytes.functional.dequantize_4bit``."""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import torch

from .errors import ArgumentError
from .formats.bnb4 import canonical_code, check_state
from .kernels.replay import ReplayCache

BACKENDS = ("auto", "triton", "cpu")
_replays = ReplayCache()


def _code_table(quant_type: str, device: torch.device) -> torch.Tensor:
    """The cached kernel table; under torch.compile a constant of the graph. Traced, the cache's dict would be
    guarded on, and filling it on the first call would fail that guard: a recompile at the second layer.

    Its result must go straight into the op, never out of a function: where Dynamo compiles a function on its own
    (after a graph break, e.g. once an ArgumentError fell back to eager) and that function returns the table, it
    rebuilds the value by the global name ``_code_table``, which in this module is this function: every later call
    then passed the function as the table (torch 2.13)."""
    return canonical_code(quant_type, device)


# What torch.compiler.assume_constant_result sets; calling it imports torch._dynamo (a second or more), which
# every eager user and the converter would pay at import. tests/test_compile.py checks that it still works.
_code_table._dynamo_marked_constant = True


def _fields(packed: torch.Tensor, quant_state: Any, out: Optional[torch.Tensor], backend: str):
    """Check the arguments; return the kernel's inputs from the quant state: (absmax, code2, absmax2, offset, nested
    blocksize). The code table is fetched where it is passed on (_table's docstring says why)."""
    if backend not in BACKENDS:
        raise ArgumentError(f"backend must be one of {BACKENDS}, not {backend!r}")
    if not isinstance(packed, torch.Tensor):
        raise ArgumentError(f"packed must be a tensor, not {type(packed).__name__}")
    if not packed.is_contiguous():
        raise ArgumentError("packed must be contiguous")
    check_state(packed.numel() * packed.element_size(), quant_state)
    device = packed.device
    absmax = quant_state.absmax
    code2 = absmax2 = offset = None
    nested_blocksize = 0
    if quant_state.nested:
        state2 = quant_state.state2
        nested_blocksize = int(state2.blocksize)
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
        if not isinstance(out, torch.Tensor):
            raise ArgumentError(f"out must be a tensor, not {type(out).__name__}")
        if out.dtype != quant_state.dtype:
            raise ArgumentError(f"out has dtype {out.dtype}, the quant state's is {quant_state.dtype}")
        if out.numel() != math.prod(quant_state.shape):
            raise ArgumentError(
                f"out has {out.numel()} elements, shape {tuple(quant_state.shape)} needs {math.prod(quant_state.shape)}"
            )
        if out.device != device or not out.is_contiguous():
            raise ArgumentError(f"out must be contiguous on {device}")
    _refuse_amd(device)
    _pick_backend(backend, device)
    return absmax, code2, absmax2, offset, nested_blocksize


def _refuse_amd(device: torch.device) -> None:
    """An AMD GPU's tensors (torch's "cuda" on a ROCm build): the Triton kernel (NVIDIA PTX) cannot run there. Its own
    function, apart from _pick_backend's raises: in that one, on torch 2.11 (Python 3.12), Dynamo then failed on its
    later raises with an internal AssertionError instead of letting the ArgumentError out."""
    if device.type == "cuda" and torch.version.hip is not None:
        from .devices import AMD_GPU

        raise ArgumentError(f"packed is on {AMD_GPU}; dequantize a copy on the CPU (backend='cpu')")


def _pick_backend(backend: str, device: torch.device) -> str:
    # Triton is imported only when the kernel runs: the CPU path never pays for it.
    if backend == "auto":
        return "triton" if device.type == "cuda" else "cpu"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ArgumentError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")
    if backend == "cpu" and device.type != "cpu":
        raise ArgumentError(f"backend='cpu' needs CPU tensors, not {device.type} tensors")
    return backend


def _compiled(packed, quant_state, fields, out, backend):
    """Under torch.compile: a registered op per backend, whose tables and offset travel as tensors. CUDA (and the
    Triton interpreter): the triton_op. CPU: an opaque custom op around the exact CPU path, so that Inductor cannot
    contract its multiplies and adds into FMAs (kernels/compiled.py)."""
    from .kernels import compiled  # registers the ops

    if backend == "triton" and not compiled.HAS_TRITON:
        from .devices import no_triton

        raise no_triton(f"dequantizing {packed.device.type} tensors with backend={backend!r}")
    absmax, code2, absmax2, offset, nested_blocksize = fields
    shape = tuple(quant_state.shape)
    op = torch.ops.nf4convert.dequantize_4bit if backend == "triton" else torch.ops.nf4convert.dequantize_4bit_cpu
    result = op(
        packed,
        absmax,
        code2,
        absmax2,
        offset,
        _code_table(quant_state.quant_type, packed.device),
        quant_state.blocksize,
        nested_blocksize,
        list(shape),
        quant_state.dtype,
    )
    if out is None:
        return result
    out.copy_(result.view(out.shape))
    return out.view(shape)


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

    Raises:
        ArgumentError (a ValueError): a quant state or argument that cannot be dequantized (dtype, blocksize,
            quant type, sizes that do not fit the shape, a quant state that is not one or lacks a field, a field of the
            wrong type, ``out`` that is not a tensor or of the wrong dtype/size/device, a bad backend). Under
            torch.compile the same checks run while tracing: without ``fullgraph`` the error is this one (Dynamo
            falls back to eager there); with ``fullgraph=True`` Dynamo reports the raise as unsupported at trace time.
        DependencyError: the Triton backend without Triton installed.

    Example:
        >>> import bitsandbytes.functional as F
        >>> packed, state = F.quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
        >>> dense = nf4convert.dequantize_4bit(packed, state)   # == F.dequantize_4bit(packed, state)
    """
    if quant_state is None:
        quant_state = getattr(packed, "quant_state", None)
        if quant_state is None:
            raise ArgumentError("quant_state is required unless packed is a bitsandbytes Params4bit")
    if isinstance(packed, torch.nn.Parameter):
        packed = packed.data
    compiling = torch.compiler.is_compiling()
    if not compiling and out is None and (backend == "auto" or backend == "triton") and quant_state in _replays:
        result = _replays.replay(packed, quant_state)
        if result is not None:
            return result
    fields = _fields(packed, quant_state, out, backend)
    backend = _pick_backend(backend, packed.device)  # checked in _fields
    if compiling:
        return _compiled(packed, quant_state, fields, out, backend)

    absmax, code2, absmax2, offset, nested_blocksize = fields
    code = _code_table(quant_state.quant_type, packed.device)
    shape = tuple(quant_state.shape)
    if out is None:
        out = torch.empty(shape, dtype=quant_state.dtype, device=packed.device)
    if backend == "cpu":
        from .kernels.cpu import dequantize_tensors

        dequantize_tensors(packed, absmax, code2, absmax2, offset, code, out, quant_state.blocksize, nested_blocksize)
    else:
        try:
            from .kernels import launch
        except ImportError as error:
            if (error.name or "").split(".")[0] != "triton":
                raise
            from .devices import no_triton

            raise no_triton(f"dequantizing {packed.device.type} tensors with backend={backend!r}") from None
        replay = launch.launch(
            packed, absmax, code2, absmax2, offset, code, out, quant_state.blocksize, nested_blocksize
        )
        # Only launches that read the quant state's own tensors (no converted copies) can be replayed.
        state2 = quant_state.state2 if quant_state.nested else None
        if (
            replay is not None
            and absmax is quant_state.absmax
            and (code2 is None or (code2 is state2.code and absmax2 is state2.absmax and offset is quant_state.offset))
        ):
            _replays.remember(packed, quant_state, replay)
    return out.view(shape)
