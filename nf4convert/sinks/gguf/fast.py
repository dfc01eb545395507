"""Fast paths for the converter's tensors, taken only where they give the converter's bytes.

The converter turns each tensor into a lazy graph: our tensor, cast to fp32 (``.to(torch.float32)``, for every dtype
but fp16 and fp32), its own layout steps (the q/k permute, a transpose), ``.numpy()``, then gguf-py's conversion to the
GGUF type. Run as it stands, that graph upcasts every bf16 weight to fp32 and rounds it back in numpy, and quantizes
Q8_0 on one core. Where a graph has exactly that shape and its layout steps only move values (``LAYOUT``), the same
bytes come from:

- ``same``: the GGUF type is the tensor's own dtype (bf16, fp16, fp32): the layout steps on our tensor, no fp32 round
  trip; for bf16 every NaN gets its quiet bit, as gguf-py's rounding sets it;
- ``q8_0``: the layout steps on our tensor, then Q8_0 blocks computed with torch on the route's device
  (``q8_0.py``), chunk by chunk.

Any other graph (an arithmetic step, a tensor made from several, a type gguf-py falls back from) is left to the
converter. Graph nodes are recognised by the code of the converter's own lazy wrappers (``_Codes``), found by building
a small graph with them, not by their names.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from .q8_0 import quiet_bf16

SAME_CHUNK_VALUES = 1 << 22  # values handed to the writing threads at once, for a type written as it is made
REQUANT_CHUNK_VALUES = 1 << 18  # values each writing thread quantizes at once for llama-quantize's types

# tensor methods that only move values (or view them): replaying them on bf16 instead of fp32 moves the same bits
LAYOUT = frozenset(
    {
        "reshape",
        "view",
        "permute",
        "swapaxes",
        "swapdims",
        "transpose",
        "t",
        "contiguous",
        "squeeze",
        "unsqueeze",
        "flatten",
        "unflatten",
        "movedim",
        "expand",
        "clone",
    }
)
# of those, the ones that keep the values' row-major order: a tensor whose steps are all of these holds in the GGUF the
# values of our tensor in our order, so each piece of ours is GGUF bytes at a place known from the piece alone
ORDER_KEEPING = frozenset({"reshape", "view", "contiguous", "squeeze", "unsqueeze", "flatten", "unflatten", "clone"})


@dataclass(frozen=True)
class _Codes:
    """What the converter's lazy wrappers look like, found by building a small graph with them."""

    method: object  # the code of LazyTorchTensor's wrapper of a tensor method (the method's name in its closure)
    numpy: object  # the code of LazyTorchTensor.numpy's function
    astype: object  # the code of LazyNumpyTensor.astype's function
    quantize: dict  # gguf-py's quantize functions: the function -> its GGMLQuantizationType


@functools.cache
def _codes() -> _Codes:
    import numpy as np
    import torch

    from .converter import converter

    gguf, conversion = converter()
    lazy = conversion.LazyTorchTensor
    probe = lazy(meta=lazy.meta_with_dtype_and_shape(torch.float32, (1, 32)), args=(), func=lambda: None)
    reshaped = probe.reshape(1, 32)
    as_numpy = reshaped.numpy()
    quantize = {}
    for qtype in (gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.Q8_0):
        quantize[gguf.quants.quantize(as_numpy, qtype)._func] = qtype
    return _Codes(
        reshaped._func.__code__,
        as_numpy._func.__code__,
        as_numpy.astype(np.float16, copy=False)._func.__code__,
        quantize,
    )


def _method(node, codes: _Codes) -> str | None:
    """The tensor method a LazyTorchTensor node calls, if it is one of the converter's method wrappers."""
    function = node._func
    if getattr(function, "__code__", None) is not codes.method:
        return None
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
    return cells["name"].cell_contents if "name" in cells else None


@dataclass
class Recognised:
    """A graph the fast paths take: ``source`` (the name ``make_tensor`` makes), the layout ``steps`` the converter
    applies to it (functions of one tensor, in order), what gguf-py then does (``"same"`` or ``"q8_0"``), and whether
    every step keeps the values' order (``streamed``: written piece by piece as made, ``streamed.py``)."""

    source: str
    steps: list
    kind: str
    streamed: bool = False


def recognise(lazy, is_source: Callable, gguf) -> Recognised | None:
    """What ``lazy`` (the converter's graph for one written tensor) is, if a fast path gives its bytes; else None.
    ``is_source(node)`` -> the source tensor's name for a node that makes one of ours, else None."""
    import numpy as np
    import torch
    from gguf.lazy import LazyBase

    codes = _codes()
    quant = gguf.GGMLQuantizationType
    node, kind = lazy, None
    func = node._func
    if func in codes.quantize and len(node._args) == 1:
        kind = {quant.BF16: "bf16", quant.Q8_0: "q8_0"}[codes.quantize[func]]
    elif getattr(func, "__code__", None) is codes.astype and len(node._args) == 2:
        kind = {np.dtype(np.float16): "f16", np.dtype(np.float32): "f32"}.get(np.dtype(node._args[1]))
    if kind is None or node._kwargs.get("copy", False):
        return None
    node = node._args[0]
    if not isinstance(node, LazyBase) or getattr(node._func, "__code__", None) is not codes.numpy:
        return None
    node = node._args[0]
    steps = []
    upcast = False
    ordered = True
    while isinstance(node, LazyBase):
        name = is_source(node)
        if name is not None:
            break
        method = _method(node, codes)
        lazies = [arg for arg in (*node._args, *node._kwargs.values()) if isinstance(arg, LazyBase)]
        if method is None or len(lazies) != 1 or node._args[0] is not lazies[0]:
            return None
        rest = (*node._args[1:], *node._kwargs.values())
        if method == "to" and rest == (torch.float32,) and is_source(node._args[0]) is not None:
            upcast = True  # the converter's upcast, right on our tensor
        elif method in LAYOUT and not any(isinstance(arg, torch.dtype) for arg in rest):
            steps.append(functools.partial(_replay, node._func, node._args[1:], node._kwargs))
            ordered = ordered and method in ORDER_KEEPING
        else:
            return None
        node = node._args[0]
    else:
        return None
    dtype = node._meta.dtype
    if kind == "q8_0":
        return Recognised(name, steps[::-1], "q8_0", ordered)
    same = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[kind]
    if dtype != same or upcast != (dtype == torch.bfloat16):  # gguf-py converts between types: left to it
        return None
    return Recognised(name, steps[::-1], "same", ordered)


def _replay(function, args, kwargs, tensor):
    return function(tensor, *args, **kwargs)


class FastTensor:
    """Stands for one of the converter's lazy tensors in its writer (which asks only ``nbytes`` and ``tofile``): the
    same bytes, made by a fast path. A ``stream`` (``streamed.StreamedTensor``) has them written piece by piece as the
    feed makes them; otherwise the tensor is taken whole (``take``), its layout steps run on ``device``, and its bytes
    handed to ``writes()`` (the file's ``writes.PositionalWrites``) at the place ``tofile`` is given, which it moves
    past them. ``quantizer()``: the ``q8_0.Q8_0`` to quantize with."""

    def __init__(
        self,
        recognised: Recognised,
        nbytes: int,
        take: Callable,
        device,
        quantizer: Callable,
        writes,
        stream=None,
        retyped=None,
    ):
        self.recognised, self.nbytes, self.stream, self.retyped = recognised, nbytes, stream, retyped
        self._take, self._device, self._quantizer, self._writes = take, device, quantizer, writes

    def tofile(self, out) -> None:
        import torch

        start = out.tell()
        if self.stream is not None:  # written by the feed's pipeline, piece by piece
            out.seek(start + self.nbytes)
            return
        writes = self._writes()
        tensor = self._take(self.recognised.source)
        if tensor.device != torch.device(self._device):
            tensor = tensor.to(self._device)
        for step in self.recognised.steps:
            tensor = step(tensor)
        values = tensor.contiguous().view(-1)
        del tensor
        if self.retyped is not None:  # the "same" bytes are llama-quantize's input: quantized on the writing threads
            raw = values.view(torch.uint8).cpu().numpy()
            quiet = values.dtype == torch.bfloat16
            put_requantized(writes, start, raw, self.retyped, quiet)
            out.seek(start + self.nbytes)
            return
        quantize = self._quantizer() if self.recognised.kind == "q8_0" else None
        step = quantize.chunk_values if quantize is not None else SAME_CHUNK_VALUES
        written = 0
        for first in range(0, values.numel(), step):
            chunk = values[first : first + step]
            prepare = None
            if quantize is not None:  # into the quantizer's own buffers: copied out before the next chunk
                made = quantize(chunk).to("cpu", copy=True)
            else:
                made = chunk.view(torch.uint8).cpu()
                prepare = _quiet_bf16_bytes if chunk.dtype == torch.bfloat16 else None  # on the writing threads
            writes.put(start + written, made, prepare)
            written += made.numel()
        if written != self.nbytes:
            from ...errors import InternalError

            raise InternalError(f"a GGUF tensor of {self.nbytes} bytes was written with {written}")
        out.seek(start + written)


def _quiet_bf16_bytes(raw):
    """bf16 bytes (a uint8 numpy array) with every NaN's quiet bit set, as gguf-py writes them."""
    import torch

    return quiet_bf16(torch.from_numpy(raw).view(torch.int16)).view(torch.uint8).numpy()


def put_requantized(writes, start: int, raw, retyped, quiet: bool = False) -> None:
    """IN's bytes of a whole tensor (uint8, ``retyped.source``'s values; ``quiet``: bf16 whose NaNs get their quiet bit
    first, as gguf-py writes them) handed to ``writes`` from ``start`` as OUT's, a run of rows at a time, each run
    quantized on the writing thread that writes it."""
    from ...errors import InternalError

    width = retyped.source_row_bytes
    if raw.size != retyped.n_rows * width:
        raise InternalError(f"{retyped.name}: {raw.size} bytes made for {retyped.n_rows} rows of {width}")
    step = max(1, REQUANT_CHUNK_VALUES // retyped.row_values)
    for row in range(0, retyped.n_rows, step):
        part = raw[row * width : (row + step) * width]
        writes.put(start + row * retyped.row_bytes, part, functools.partial(_requantize, retyped, row, quiet))


def _requantize(retyped, row: int, quiet: bool, raw):
    return retyped.quantize(_quiet_bf16_bytes(raw) if quiet else raw, row)
