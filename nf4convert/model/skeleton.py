"""The model transformers builds from a checkpoint's config.json, on the meta device (no weights): what class each
module has, what shape each parameter, and which of its parameters a checkpoint's tensors leave unloaded. Imports
transformers (seconds) only when first asked."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable

from .. import preload


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' config and model warnings, and its loading bar, are not this tool's output."""
    preload.settled()  # transformers may be importing on the preload thread
    import transformers

    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        quiet.setLevel(level)
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _built(config: dict | None):
    """The model transformers builds from ``config`` on the meta device (its ``architectures`` class, else AutoModel's);
    raises what transformers raises where it cannot."""
    import torch
    import transformers

    settings = {k: v for k, v in (config or {}).items() if k not in ("dtype", "torch_dtype")}
    built = transformers.AutoConfig.for_model(**settings)
    architecture = getattr(transformers, (config.get("architectures") or [""])[0], None)
    with torch.device("meta"):
        return architecture._from_config(built) if architecture else transformers.AutoModel.from_config(built)


def why_unbuilt(config: dict | None, error: BaseException) -> str:
    """Why transformers built no model from ``config``, in a line: an unknown model_type named as such (transformers'
    own message lists every type it knows, kilobytes of them), anything else by its first line, shortened."""
    import transformers

    model_type = (config or {}).get("model_type")
    known = getattr(transformers, "CONFIG_MAPPING", {})
    if isinstance(error, (ValueError, KeyError)) and isinstance(model_type, str) and model_type not in known:
        return f"transformers {transformers.__version__} does not know model_type {model_type!r}"
    text = str(error).splitlines()[0] if str(error) else ""
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def meta_model(config: dict | None) -> tuple[Callable, Callable, Callable, Callable]:
    """(module path -> its class, tensor name -> its shape, -> why there is no model, module path -> the module) in the
    model transformers builds from ``config`` (on the meta device, no weights), each None where that cannot be built
    or has no such part: the answers to "Linear, Conv1D or Embedding?", "what shape does the model load here?" and
    "which parameters does this module register, in what order, and how are its experts laid out?" from transformers'
    own model (verify's, and the adapter check's where a name does not tell: adapters/lora.py). Built when first
    asked."""

    failure = []

    @functools.lru_cache(maxsize=1)
    def model():
        with _quiet_transformers():
            try:
                return _built(config)
            except Exception as error:  # noqa: BLE001  (an unknown architecture: fall back to Linear, no shapes; said in a note)
                failure.append(why_unbuilt(config, error))
                return None

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


def loaded(config: dict | None, tensors: dict[str, tuple]):
    """What transformers makes of a checkpoint of ``tensors`` (name -> shape) loaded into the model it builds from
    ``config``, by its own loading rules (its key renames and conversions, its tied weights, the keys its model may
    lack): (the model's class name, the parameters it leaves at their random initial values, the parameters it is
    given in another shape than its own as (name, given, its own), the conversions that failed as (name, why)). A
    string saying why that cannot be told where it cannot: ``Unbuilt`` (no model), or a plain string (a transformers
    without those rules, or rules that changed under us)."""
    preload.settled()  # transformers may be importing on the preload thread
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
    except ImportError:
        import transformers

        return f"transformers {transformers.__version__} has no loading rules to ask"
    import torch

    with _quiet_transformers():
        try:
            model = _built(config)
        except Exception as error:  # noqa: BLE001  (said by the caller's note, as meta_model's failure)
            return Unbuilt(why_unbuilt(config, error))
        try:
            state = {name: torch.empty(shape, device="meta") for name, shape in tensors.items()}
            loading = LoadStateDictConfig(device_map={"": "meta"}, weight_mapping=get_model_conversion_mapping(model))
            info, _ = convert_and_load_state_dict_in_model(model, state, loading)
            model.tie_weights(missing_keys=info.missing_keys, recompute_mapping=False)
            model._adjust_missing_and_unexpected_keys(info)
        except Exception as error:  # noqa: BLE001  (transformers' loading rules changed under us: not a finding)
            return f"transformers' loading rules could not be applied ({type(error).__name__}: {error})"[:300]
    buffers = {name for name, _ in model.named_buffers()}  # computed on load (a rotary table), never random
    mismatched = sorted((name, tuple(given), tuple(own)) for name, given, own in info.mismatched_keys)
    failed = sorted(
        (name, str(why).splitlines()[0][:200] if str(why) else "") for name, why in info.conversion_errors.items()
    )
    missing = sorted(key for key in info.missing_keys if key not in buffers and key not in {m[0] for m in mismatched})
    return type(model).__name__, missing, mismatched, failed


class Unbuilt(str):
    """Why transformers built no model from a config (``loaded``'s answer where there is none)."""


def unloaded_parameters(config: dict | None, tensors: dict[str, tuple]) -> tuple[str, list[str]] | str:
    """(the model's class name, the parameters it leaves at their random initial values) when transformers loads a
    checkpoint of ``tensors`` (name -> shape) into the model it builds from ``config`` (``loaded``), or a string
    saying why that cannot be told."""
    found = loaded(config, tensors)
    return found if isinstance(found, str) else found[:2]
