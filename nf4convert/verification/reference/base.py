"""What every reference module shares: the slice it answers with, what a reference may need beyond its own tensor
(``Context``), a leaf kind's reference made whole, and the reference of a kind, found by its name.

A kind's reference is the module of this package named as the kind (``kinds/<kind>.py`` ->
``verification/reference/<kind>.py``). Each has:

- ``slices(tensor, reader, device, context, piece_bytes)``: the tensor's reference as :class:`Slice` s, each a range
  of the output tensor's bytes and how the reference library computes just that range (whole quant blocks, whole
  8-bit rows, a run of plain elements; a reference that needs the whole tensor, a merge or a transpose, is one slice);
- ``reference(tensor, reader, device, context)``: the whole tensor (what a merge or a transpose starts from);
- ``against(tensor, device)``: what the tensor is compared against, as the report names it;
- optionally ``libraries(tensor)``: the reference libraries (import names) it recomputes with beyond bitsandbytes and
  peft, which verify checks for before it reads a tensor.

A recipe is read by its fields alone: nothing here imports the convert side.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable, Iterator, NamedTuple


class Slice(NamedTuple):
    """Bytes ``[offset, offset + nbytes)`` of an output tensor as the reference computes them: ``make(read, take)``
    returns them as a flat uint8 tensor, on the CPU or the device that computed them. ``read(info, first, count)``
    gives bytes of a source tensor as a uint8 CPU tensor, ``take(nbytes)`` CPU memory to compute into (the caller
    decides where both lie and when they are reused: after the slice is compared)."""

    offset: int
    nbytes: int
    make: Callable


class Context(NamedTuple):
    """What a reference may need beyond its own tensor."""

    planned: dict  # every planned tensor by name (a merge rebuilds its module's siblings)
    module_class: Callable  # module path -> the class transformers' model has there, or None
    parameter_shape: Callable  # tensor name -> the shape transformers' model gives it, or None
    unbuilt: Callable  # -> why transformers could not build the model (once asked), or None
    module: Callable = lambda path: None  # module path -> that module of transformers' model, on the meta device
    tied: tuple = ()  # (input embeddings, head) of a tied base: they share one parameter while peft loads

    def recompute(self, tensor, reader, device):
        """``tensor`` recomputed whole by its kind's reference (a wrapper's reference recomputes its base through
        this)."""
        return reference_for(tensor.recipe.kind).reference(tensor, reader, device, self)

    def slices(self, tensor, reader, device, piece_bytes: int) -> Iterator[Slice]:
        return reference_for(tensor.recipe.kind).slices(tensor, reader, device, self, piece_bytes)


def reference_for(kind: str) -> ModuleType:
    """The reference module of the kind named ``kind`` (a recipe's ``kind``)."""
    return importlib.import_module(f"{__package__}.{kind}")


def against(tensor, device) -> str:
    """What ``tensor`` is compared against on ``device``: "bitsandbytes", "the source tensor", ..."""
    return reference_for(tensor.recipe.kind).against(tensor, device)


class Library(NamedTuple):
    """A reference library a reference computes with (peft, for an adapter's merge, is asked for apart)."""

    name: str  # its import name
    recomputes: str  # what verify recomputes with it, as a message says ("FP8 weights (compressed-tensors' ...)")
    package: str  # what pip installs it by


BITSANDBYTES = Library("bitsandbytes", "the weights (bitsandbytes' dequantization)", "bitsandbytes")


def libraries(tensors) -> list[Library]:
    """The reference libraries the references of ``tensors`` name (each reference module's ``libraries(recipe)``), in
    name order."""
    needed = set()
    for tensor in tensors:
        recipe = tensor.recipe
        while recipe is not None:  # a wrapper's base is recomputed by its own kind's reference
            named = getattr(reference_for(recipe.kind), "libraries", None)
            needed.update(named(recipe) if named else ())
            recipe = getattr(recipe, "base", None)
    return sorted(needed)


def whole(tensor, reader, device, context):
    """A leaf kind's reference made whole from its slices, as a tensor of ``tensor``'s dtype and shape (on the device
    that computed it): one copy of the tensor, not one per slice."""
    import torch

    from ...dtypes import DTYPES

    made = None
    for piece in context.slices(tensor, reader, device, 1 << 24):
        computed = piece.make(
            lambda info, first, count: reader.read(info, first, count),
            lambda nbytes: torch.empty(nbytes, dtype=torch.uint8),
        )
        if made is None:
            made = torch.empty(tensor.nbytes, dtype=torch.uint8, device=computed.device)
        made[piece.offset : piece.offset + piece.nbytes].copy_(computed)
    if made is None:  # no elements
        made = torch.empty(0, dtype=torch.uint8)
    return made.view(DTYPES[tensor.dtype].torch).reshape(tensor.shape)


def unpacking_rows(piece_bytes: int, row_bytes: int, multiple: int, device) -> int:
    """Output rows a slice of a packed integer weight (GPTQ, AWQ, compressed-tensors) recomputes at once: whole
    ``multiple`` s of them, at least one. The libraries' arithmetic these references restate makes temporaries of
    several times the slice's output bytes (shifted words, codes, gathered scales and zeros): in host memory (on the
    CPU) their slices are a quarter of ``piece_bytes``, so a verify thread holds about what the other references'
    threads hold; a GPU keeps whole slices."""
    share = 1 if getattr(device, "type", device) == "cuda" else 4
    return max(multiple, piece_bytes // share // max(row_bytes, 1) // multiple * multiple)


def as_bytes(values):
    """A tensor's bytes, flat uint8 (its own memory, no copy where it is contiguous)."""
    import torch

    return values.contiguous().reshape(-1).view(torch.uint8)
