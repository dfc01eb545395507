"""Libraries a command will need, imported on a thread of their own from the command's start, while the command does
what needs none of them: resolving and planning, reading headers, making and writing the first pieces.

The reference libraries and llama.cpp's converter take seconds to import (torch's compiler stack, transformers'
model registry), which a command otherwise waits for where it first uses them. ``start(...)`` queues them on one
background thread; where a module is first needed, ``ready(name)`` waits for that thread to be done with it and the
caller imports it itself: at once, or with the import's own error. Code that imports from the same packages on another
thread waits first (``settled``): the background thread runs beside code that imports nothing new of them (reading,
planning, making pieces).

Only while ``allowed`` (the command line, under its stop signals' handlers): Python raises Ctrl-C in the main thread
wherever it is, and a main thread interrupted while it waits for a module another thread is importing can leave that
module's lock waiting forever; the command line's handlers never raise inside an import (``cli/signals.py``).
Elsewhere (the library called from a program) ``start`` queues nothing and everything is imported where used.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
from collections import deque
from typing import Callable, Iterator

from . import profile

_lock = threading.Lock()
_allowed = [0]  # nesting depth of ``allowed`` blocks
_done: dict[str, threading.Event] = {}  # each module queued: set once the thread is done with it
_queue: deque = deque()
_thread: list[threading.Thread] = []


@contextlib.contextmanager
def allowed() -> Iterator[None]:
    """Background imports may run during the block (the caller handles stop signals outside imports)."""
    with _lock:
        _allowed[0] += 1
    try:
        yield
    finally:
        with _lock:
            _allowed[0] -= 1


def start(*modules: str | tuple[str, Callable[[], object]], here: tuple[str, ...] = ("torch",)) -> None:
    """Import ``modules`` in order on the background thread: a module's name, or ``(name, importer)`` where the import
    is ``importer()``. One already imported or queued is skipped; nothing is queued unless ``allowed``.

    ``here``: modules they import that are imported first on this thread, not on the side: code asks whether torch is
    in use by looking it up in ``sys.modules``, where a module another thread is importing is there half made."""
    with _lock:
        if not _allowed[0]:
            return
    try:
        for name in here:
            importlib.import_module(name)
    except ImportError:  # nothing to begin: each module's import says so where it is needed
        return
    with _lock:
        for module in modules:
            name, importer = module if isinstance(module, tuple) else (module, None)
            if name in _done or name in sys.modules:
                continue
            _done[name] = threading.Event()
            _queue.append((name, importer))
        if _queue and not (_thread and _thread[0].is_alive()):
            _thread[:] = [threading.Thread(target=_run, name="nf4convert-preload", daemon=True)]
            _thread[0].start()


def ready(name: str) -> bool:
    """Wait until the background thread is done with ``name`` (imported or failed), if it was queued; whether it was."""
    done = _done.get(name)
    if done is not None:
        done.wait()
    return done is not None


def settled() -> None:
    """Wait until the background thread has done everything queued: where a thread is about to import what it may be
    importing (transformers, huggingface_hub beneath it). Two threads importing one web of packages at once can each
    wait for a module the other is part way through, and Python then hands one of them that module half made."""
    for done in list(_done.values()):
        done.wait()


def _run() -> None:
    while True:
        with _lock:
            if not _queue:
                _thread.clear()
                return
            name, importer = _queue.popleft()
        try:
            importer() if importer is not None else importlib.import_module(name)
        except BaseException:  # noqa: BLE001, S110  (the caller's own import says it, where the module is needed)
            pass
        finally:
            profile.mark(f"preloaded {name}")
            _done[name].set()
