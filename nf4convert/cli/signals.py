"""The command line's handlers of the signals that stop a run (``errors.STOP_SIGNALS``: SIGINT, SIGTERM, SIGHUP):
under :class:`StopSignals` they become exceptions, ``errors.Interrupted`` and ``errors.Terminated``, that unwind a run
like any failure, so that what was partly written is removed (``sinks.output.held`` makes them wait while OUT is put in
place). A signal the caller ignores (``nohup``, ``trap '' INT``) stays ignored.
"""

from __future__ import annotations

import signal
import sys
import threading
from functools import partial

from ..errors import STOP_SIGNALS, Interrupted, Terminated


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
        _probe_tempdir()
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


def _probe_tempdir() -> None:
    """Python's tempfile finds its folder on first use by writing a probe file there and removing it; a stop signal
    between the two (the process then ends) leaves the probe behind. It is made once here, with the stop signals held
    back, so that no later use probes."""
    import tempfile

    if tempfile.tempdir is not None or not hasattr(signal, "pthread_sigmask"):
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        tempfile.gettempdir()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
