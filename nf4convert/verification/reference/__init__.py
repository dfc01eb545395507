"""The references verify recomputes each tensor kind with, one module per kind under the same name as in ``kinds/``:
bitsandbytes, peft and torch only, never nf4convert's kernels or converter code.

Each module has:

- ``slices(tensor, reader, device, context, piece_bytes)``: the tensor's reference as :class:`Slice` s, each a range
  of the output tensor's bytes and how the reference library computes just that range (whole quant blocks, whole
  8-bit rows, a run of plain elements; a reference that needs the whole tensor, a merge or a transpose, is one slice);
- ``reference(tensor, reader, device, context)``: the whole tensor (what a merge or a transpose starts from);
- ``against(tensor, device)``: what the tensor is compared against, as the report names it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable, Iterator, NamedTuple

from . import copy, dequantize_4bit, dequantize_8bit, merge_lora, transpose, untied
from .base import Slice, as_bytes, whole

REFERENCES: dict[str, ModuleType] = {
    "copy": copy,
    "dequantize_4bit": dequantize_4bit,
    "dequantize_8bit": dequantize_8bit,
    "transpose": transpose,
    "untied": untied,
    "merge_lora": merge_lora,
}


class Context(NamedTuple):
    """What a reference may need beyond its own tensor."""

    planned: dict  # every planned tensor by name (a merge rebuilds its module's siblings)
    module_class: Callable  # module path -> the class transformers' model has there, or None
    parameter_shape: Callable  # tensor name -> the shape transformers' model gives it, or None
    unbuilt: Callable  # -> why transformers could not build the model (once asked), or None
    tied: tuple = ()  # (input embeddings, head) of a tied base: they share one parameter while peft loads

    def recompute(self, tensor, reader, device):
        """``tensor`` recomputed whole by its kind's reference (a wrapper's reference recomputes its base through
        this)."""
        return REFERENCES[tensor.recipe.kind].reference(tensor, reader, device, self)

    def slices(self, tensor, reader, device, piece_bytes: int) -> Iterator[Slice]:
        return REFERENCES[tensor.recipe.kind].slices(tensor, reader, device, self, piece_bytes)


def against(tensor, device) -> str:
    """What ``tensor`` is compared against on ``device``: "bitsandbytes", "the source tensor", ..."""
    return REFERENCES[tensor.recipe.kind].against(tensor, device)


__all__ = ["REFERENCES", "Context", "Slice", "against", "as_bytes", "whole"]
