"""The model transformers builds from a checkpoint's config.json, on the meta device (no weights): what class each
module has, and what shape each parameter. Imports transformers (seconds) only when first asked."""

from __future__ import annotations

import functools
import logging
from typing import Callable

from . import preload


def meta_model(config: dict | None) -> tuple[Callable, Callable, Callable, Callable]:
    """(module path -> its class, tensor name -> its shape, -> why there is no model, module path -> the module) in the
    model transformers builds from ``config`` (on the meta device, no weights), each None where that cannot be built
    or has no such part: the answers to "Linear, Conv1D or Embedding?", "what shape does the model load here?" and
    "which parameters does this module register, in what order, and how are its experts laid out?" from transformers'
    own model (verify's, and the adapter check's where a name does not tell: formats/peft_lora.py). Built when first
    asked."""

    failure = []

    @functools.lru_cache(maxsize=1)
    def model():
        preload.settled()  # transformers may be importing on the preload thread
        import torch
        import transformers

        quiet = logging.getLogger("transformers")  # its config and model warnings are not this tool's output
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            settings = {k: v for k, v in (config or {}).items() if k not in ("dtype", "torch_dtype")}
            built = transformers.AutoConfig.for_model(**settings)
            architecture = getattr(transformers, (config.get("architectures") or [""])[0], None)
            with torch.device("meta"):
                return architecture._from_config(built) if architecture else transformers.AutoModel.from_config(built)
        except Exception as error:  # noqa: BLE001  (an unknown architecture: fall back to Linear, no shapes; said in a note)
            failure.append(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            return None
        finally:
            quiet.setLevel(level)

    def module_class(path: str):
        built = model()
        try:
            return type(built.get_submodule(path)) if built is not None else None
        except AttributeError:
            return None

    def parameter_shape(name: str):
        built = model()
        module, _, leaf = name.rpartition(".")
        try:
            held = getattr(built.get_submodule(module), leaf) if built is not None else None
        except AttributeError:
            return None
        return tuple(held.shape) if hasattr(held, "shape") else None

    def module(path: str):
        built = model()
        try:
            return built.get_submodule(path) if built is not None else None
        except AttributeError:
            return None

    return module_class, parameter_shape, lambda: failure[0] if failure else None, module
