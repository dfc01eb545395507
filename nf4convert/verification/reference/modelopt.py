"""nvidia-modelopt as the reference of ModelOpt's formats: its qtensor class where the library imports, and what a
verdict names it (the library's version, or the pinned source the restatement follows)."""

from __future__ import annotations

import functools

VERSION = "0.47.0"  # the nvidia-modelopt source the restatements follow


@functools.cache
def qtensor(module: str, name: str):
    """ModelOpt's qtensor class ``name`` from ``modelopt.torch.quantization.qtensor.<module>`` where nvidia-modelopt
    imports, else None."""
    import importlib
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # modelopt warns of any transformers it was not tested with
            return getattr(importlib.import_module(f"modelopt.torch.quantization.qtensor.{module}"), name)
    except Exception:  # noqa: BLE001  (not installed, or its own imports fail: the restatement stands in)
        return None


def against(name: str, found) -> str:
    """What a verdict names as the reference: the installed library's ``name.dequantize``, or the restatement."""
    if found is not None:
        from importlib.metadata import version

        return f"nvidia-modelopt {version('nvidia-modelopt')} ({name}.dequantize)"
    return f"nvidia-modelopt {VERSION} ({name}.dequantize, restated)"
