"""The reference libraries verify recomputes with: imported (one line naming what cannot be, and how to install it),
and their logs quieted while verifying."""

from __future__ import annotations

import contextlib

from ..errors import DependencyError


@contextlib.contextmanager
def quiet_loggers():
    """bitsandbytes warns on import about an optional CPU matmul kernel that verification never uses, and peft about
    the stand-in models it is handed (in its log and as Python warnings: a config key it does not know, a layer class
    it adjusts fan_in_fan_out for): quiet while verifying, as the caller had them after."""
    import logging
    import warnings

    loggers = [logging.getLogger(name) for name in ("bitsandbytes.backends.cpu.ops", "peft")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"peft(\.|$)")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def reference_library(name: str, what: str | None = None, package: str | None = None) -> None:
    """DependencyError unless ``name`` imports: without its reference library verify can recompute nothing, which is
    not a difference in the weights. ``what`` it recomputes, and the ``package`` that installs it, where a reference
    module says (``LIBRARY``: compressed-tensors' decompression)."""
    import importlib

    try:
        importlib.import_module(name)
    except Exception as error:  # noqa: BLE001  (ImportError, or a broken install failing inside its import)
        if what is None:
            what = "LoRA merges (peft's own merge)" if name == "peft" else "the weights (bitsandbytes' dequantization)"
        raise DependencyError(
            f"verify recomputes {what} with {name}, which cannot be imported ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); install it: pip install {package or name}"
        ) from None
