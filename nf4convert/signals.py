"""The signals that stop a run: SIGINT (Ctrl-C), SIGTERM (kill, timeout, docker stop), SIGHUP (a closed terminal or
ssh session). Under the command line (:class:`StopSignals`) they become exceptions, ``errors.Interrupted`` and
``errors.Terminated``, that unwind a run like any failure, so that what was partly written is removed; ``held`` makes
them wait while OUT is put in place. A signal the caller ignores (``nohup``, ``trap '' INT``) stays ignored.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from functools import partial
from pathlib import Path

from .errors import Interrupted, Terminated

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class StopSignals:
    """While entered, the stop signals raise ``Interrupted`` / ``Terminated`` in the main thread, but never inside an
    import: an exception raised in importlib's own code can leave a module's import lock held, and a thread importing
    that module then waits forever. There the signal is sent again 50 ms later. ``received`` lists every stop signal
    that came; after :meth:`finish` they are recorded, not raised."""

    def __init__(self):
        self.received: list[int] = []
        self._running = False
        self._resend = threading.Lock()  # a resend and the end of the command (handlers restored) never interleave
        self._previous: dict = {}
        self._unraisable_hook = None

    def __enter__(self):
        self._previous = {
            number: signal.signal(number, self._on_signal)
            for number in STOP_SIGNALS
            if signal.getsignal(number) is not signal.SIG_IGN
        }
        self.received.clear()
        self._running = True
        self._unraisable_hook, sys.unraisablehook = sys.unraisablehook, partial(_unraisable, sys.unraisablehook)
        return self

    def finish(self) -> None:
        """The command is over: a stop signal from here on is recorded, not raised (our handlers stay)."""
        with self._resend:
            self._running = False

    def __exit__(self, *exc_info):
        with self._resend:
            self._running = False
            for number, handler in self._previous.items():
                signal.signal(number, handler)
        sys.unraisablehook = self._unraisable_hook

    def _on_signal(self, signum, frame):
        self.received.append(signum)
        if not self._running:
            return  # the command is over (a resend raced its end): nothing left to stop
        if _inside_import(frame) and hasattr(signal, "pthread_kill"):
            timer = threading.Timer(0.05, self._send_again, (threading.main_thread().ident, signum))
            timer.daemon = True  # never holds up the exit
            timer.start()
            return
        raise Interrupted if signum == signal.SIGINT else Terminated(signum)

    def _send_again(self, thread: int, signum: int) -> None:
        with self._resend:
            if self._running:
                signal.pthread_kill(thread, signum)


def _inside_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _unraisable(previous, unraisable) -> None:
    """A stop signal raised in a destructor or weakref callback, which Python cannot propagate: not printed as a
    traceback; the command reports the signal (``StopSignals.received``) when it returns."""
    if not isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated)):
        previous(unraisable)


@contextlib.contextmanager
def held(output: Path):
    """SIGINT, SIGTERM and SIGHUP wait while OUT is put in place and the run winds down (main thread only), so that
    none can leave the user's OUT half-replaced or a complete OUT reported as not written. A signal that came is
    delivered at the end, its exception's ``output_complete`` set to OUT when the block finished."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {number: signal.signal(number, lambda signum, frame: came.append(signum)) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if came:
        handler = previous[came[0]]
        if handler is signal.SIG_DFL:
            signal.raise_signal(came[0])  # the default action: the process ends (OUT is complete)
        elif callable(handler):
            try:
                handler(came[0], None)
            except (Interrupted, Terminated) as stop:
                stop.output_complete = output
                raise
