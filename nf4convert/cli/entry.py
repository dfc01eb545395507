"""The ``nf4convert`` console script and ``python -m nf4convert``: a stop signal before the command line is ready is
a quiet exit, then the command line (``commands.py``) runs under its own handlers (``signals.StopSignals``).

Python raises Ctrl-C as a KeyboardInterrupt wherever it lands, and the command line's start (click, the API's
imports) takes a moment: a Ctrl-C then was a traceback. Nothing is written before the command line's handlers take
over, so until then SIGINT, SIGTERM and SIGHUP end the process at once with the status a shell gives a program they
stop (130, 143, 129), saying nothing. A signal the caller ignores (``nohup``, ``trap '' INT``) stays ignored. The
handlers are set as this module is imported, its first statements after the package's few: it is imported only to
run the command (the tests import ``commands``). ``_signal``, the C module beneath ``signal``, is loaded
when Python starts: taking it imports nothing that a signal could interrupt. Before these statements run Python's own
start-up and the console script's imports of ``nf4convert`` and ``nf4convert.cli`` (a few assignments): a Ctrl-C
there is Python's to report (docs/cli.md says so; tests/test_cli_process.py checks that nothing else runs first).
"""

import _signal
import os


def _quiet_exit(signum, frame):
    os._exit(128 + signum)


for _name in ("SIGINT", "SIGTERM", "SIGHUP"):
    _number = getattr(_signal, _name, None)
    if _number is not None and _signal.getsignal(_number) != _signal.SIG_IGN:
        _signal.signal(_number, _quiet_exit)


def main(*args, **kwargs):
    """Run the command line (``cli.main``'s arguments)."""
    from .commands import main as command_line

    return command_line(*args, **kwargs)
