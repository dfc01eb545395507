"""The references verify recomputes each tensor kind with, one module per kind under the same name as in ``kinds/``:
bitsandbytes, peft and torch only, never nf4convert's kernels or converter code. Each module has ``reference(tensor,
reader, device, context) -> torch.Tensor`` and ``BLAME``, whom a difference is blamed on."""

from __future__ import annotations

from types import ModuleType
from typing import Callable, NamedTuple

from . import copy, dequantize_4bit, dequantize_8bit, merge_lora, transpose, untied

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
        """``tensor`` recomputed by its kind's reference (a wrapper's reference recomputes its base through this)."""
        return REFERENCES[tensor.recipe.kind].reference(tensor, reader, device, self)


def blame(tensor) -> str:
    return REFERENCES[tensor.recipe.kind].BLAME
