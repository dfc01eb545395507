"""The reference libraries verify recomputes with: imported (one line naming what cannot be, and how to install it),
started early on the preload thread, and their logs quieted while verifying.

bitsandbytes calls ``torch.compile`` on several functions as it is imported (in ``backends/default/ops.py``: its
default dequantize and optimizer kernels), which imports torch's compiler stack (Dynamo, Inductor): seconds, for
functions verify never calls (its references are bitsandbytes' device kernels and its quant state, on the CPU its
arithmetic rebuilt from bitsandbytes' tables). ``import_bitsandbytes`` imports it with ``torch.compile`` replaced, for
the import alone, by ``compile_on_first_call``: each function compiled as torch would, on its first call, so a
function that is called computes as it would have; none is called, none is compiled.
"""

from __future__ import annotations

import contextlib
import functools
import threading

from .. import preload
from ..errors import DependencyError

_importing = threading.Lock()  # torch.compile is replaced for one import at a time


QUIET = ("bitsandbytes.backends.cpu.ops", "peft")  # loggers quieted while verifying
_quieted = threading.Lock()
_quieting = {"depth": 0, "levels": []}  # blocks quieting now (on any thread); the levels found by the first


@contextlib.contextmanager
def _quiet_levels():
    """The loggers of ``QUIET`` at ERROR during the block, from any thread: the first block in sets them, the last out
    restores what the first found (blocks on two threads, one importing on the side, overlap)."""
    import logging

    loggers = [logging.getLogger(name) for name in QUIET]
    with _quieted:
        if not _quieting["depth"]:
            _quieting["levels"] = [logger.level for logger in loggers]
            for logger in loggers:
                logger.setLevel(logging.ERROR)
        _quieting["depth"] += 1
    try:
        yield
    finally:
        with _quieted:
            _quieting["depth"] -= 1
            if not _quieting["depth"]:
                for logger, level in zip(loggers, _quieting["levels"]):
                    logger.setLevel(level)


@contextlib.contextmanager
def quiet_loggers():
    """bitsandbytes warns on import about an optional CPU matmul kernel that verification never uses, and peft about
    the stand-in models it is handed (in its log and as Python warnings: a config key it does not know, a layer class
    it adjusts fan_in_fan_out for): quiet while verifying, as the caller had them after."""
    import warnings

    with _quiet_levels(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"peft(\.|$)")
        yield


@contextlib.contextmanager
def compile_on_first_call():
    """During the block, ``torch.compile(function, **options)`` (and its decorator form) returns a function that
    calls torch's own ``torch.compile(function, **options)`` on its first call and the compiled function from then on:
    what torch.compile returns does the same (it compiles on the first call), without importing the compiler now."""
    import torch

    compile_now = torch.compile

    def deferred(model=None, **options):
        if model is None:  # @torch.compile(...)
            return lambda function: deferred(function, **options)
        compiled = []
        lock = threading.Lock()

        @functools.wraps(model)
        def call(*args, **kwargs):
            if not compiled:
                with lock:
                    if not compiled:
                        compiled.append(compile_now(model, **options))
            return compiled[0](*args, **kwargs)

        return call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = compile_now


def import_bitsandbytes():
    """``import bitsandbytes``, its import-time ``torch.compile`` calls deferred to each function's first call."""
    import sys

    if sys.modules.get("bitsandbytes") is not None:
        return sys.modules["bitsandbytes"]
    with _importing, _quiet_levels(), compile_on_first_call():
        import bitsandbytes
    return bitsandbytes


IMPORTERS = {"bitsandbytes": import_bitsandbytes}


def reference_libraries(adapter: bool) -> tuple[str, ...]:
    """What verify begins importing before SOURCE is planned: bitsandbytes first (the reference of its checkpoints'
    weights, and peft imports it too; where it is not installed, nothing is said until a reference needs it), peft for
    an adapter, and the part of transformers its model on the meta device needs (``model/skeleton.py``)."""
    return ("bitsandbytes", *(["peft"] if adapter else []), "transformers.modeling_utils")


def importing(*names: str) -> tuple:
    """``preload.start``'s arguments for ``names``: bitsandbytes through ``import_bitsandbytes``."""
    return tuple((name, IMPORTERS[name]) if name in IMPORTERS else name for name in names)


def start_importing(*names: str) -> None:
    """Begin importing ``names`` on the preload thread (``preload.py``)."""
    preload.start(*importing(*names))


def reference_library(name: str, what: str | None = None, package: str | None = None) -> None:
    """DependencyError unless ``name`` imports: without its reference library verify can recompute nothing, which is
    not a difference in the weights. ``what`` it recomputes, and the ``package`` that installs it, where a reference
    says (compressed-tensors' decompression)."""
    import importlib

    if not preload.ready(name):
        preload.settled()  # not queued: this thread imports it, perhaps from packages the preload thread is importing
    try:
        IMPORTERS.get(name, functools.partial(importlib.import_module, name))()
    except Exception as error:  # noqa: BLE001  (ImportError, or a broken install failing inside its import)
        if what is None:
            what = "LoRA merges (peft's own merge)" if name == "peft" else "the weights (bitsandbytes' dequantization)"
        raise DependencyError(
            f"verify recomputes {what} with {name}, which cannot be imported ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); install it: pip install {package or name}"
        ) from None


def require(needed, adapter: bool) -> None:
    """DependencyError unless each reference library verify recomputes with imports (``needed``: the references'
    ``Library`` records): bitsandbytes first where the weights are its (peft imports it too), then peft for an adapter,
    then the others."""
    first = [library for library in needed if library.name == "bitsandbytes"]
    for library in first:
        reference_library(library.name, library.recomputes, library.package)
    if adapter:
        reference_library("peft")
    for library in needed:
        if library not in first:
            reference_library(library.name, library.recomputes, library.package)


def installed(name: str) -> None:
    """DependencyError at once where ``name`` is not installed at all (its import, started early, is checked by
    ``reference_library`` where it is needed)."""
    import importlib.util

    try:
        missing = importlib.util.find_spec(name) is None
    except ValueError:  # a module set to None in sys.modules: its import fails
        missing = True
    if missing:
        reference_library(name)  # its own error, as an import says it
