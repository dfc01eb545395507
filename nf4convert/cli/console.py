"""The command line as a process: ``nf4convert SOURCE`` as ``nf4convert convert SOURCE``, errors as one ``Error:`` line,
exit codes (1 bad input or a failed run, 2 a usage error, 130/143/129 a stop signal, after removing what was partly
written), stop signals reported, a closed standard output, and the exit without the interpreter's teardown. The
commands themselves are cli.py's.
"""

from __future__ import annotations

import re
import shlex
import signal
import sys
from dataclasses import dataclass

import click

from ..errors import ArgumentError, Interrupted, Nf4ConvertError, Terminated
from ..options import every_option
from ..paths import as_utf8
from .signals import StopSignals


@dataclass
class _Command:
    """What one command line's run knows of itself (click's ``ctx.obj``)."""

    stops: StopSignals
    process: bool  # running as the process's own command line (not a test's CliRunner)


class DefaultGroup(click.Group):
    """``nf4convert SOURCE ...`` means ``nf4convert convert SOURCE ...``; usage errors are one line."""

    def main(self, args=None, *rest, **kwargs):
        kwargs.pop("standalone_mode", None)
        process = args is None
        args = sys.argv[1:] if args is None else list(args)
        if not args:
            args = ["--help"]
        stdout = sys.stdout
        with StopSignals() as stops:
            try:
                code = super().main(args, *rest, standalone_mode=False, obj=_Command(stops, process), **kwargs)
                code = code if isinstance(code, int) else 0
            except click.ClickException as error:  # a bad option or argument: one line, not the usage text
                error_line(f"{error.format_message()} (see '{_help_of(getattr(error, 'ctx', None))}')")
                code = error.exit_code
            except (click.exceptions.Abort, Interrupted, Terminated) as stop:  # a stop signal outside a command's run
                code = _stopped_outside_a_run(stop)
            except SystemExit as exiting:  # a failed run (_fail, a failed verify or batch) ends as a finished one does
                code = _exit_code(exiting)
                if sys.stdout is not stdout:  # click's own help or version text met a closed pipe: click exits 1 and
                    code = 0  # puts a stand-in in stdout's place; the text was all there was to do
            if process:
                stops.finish()
                _exit_now(code)
        sys.exit(code)

    def format_options(self, ctx, formatter):
        """The group's options and commands, then convert's options: ``nf4convert SOURCE`` is a conversion."""
        super().format_options(ctx, formatter)
        convert = self.commands["convert"]
        with click.Context(convert, info_name="convert", parent=ctx) as own:
            shown = [param for param in convert.get_params(own) if isinstance(param, click.Option)]
            rows = [param.get_help_record(own) for param in shown if param is not convert.get_help_option(own)]
        with formatter.section("Convert options (nf4convert SOURCE [OPTIONS], as nf4convert convert SOURCE [OPTIONS])"):
            formatter.write_dl([row for row in rows if row])

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            _refuse_mistyped_command(args[0], list(self.commands))
            args = ["convert", *args]
        elif args and args[0].startswith("-"):  # convert's options before SOURCE (nf4convert -q SOURCE, -- SOURCE)
            own = {name for param in self.get_params(ctx) for name in (*param.opts, *param.secondary_opts)}
            if args[0].split("=", 1)[0] not in own:
                from pathlib import Path

                named = next(
                    (word for word in args if word in self.commands and word != "convert" and not Path(word).exists()),
                    None,
                )
                if named is not None:
                    raise click.UsageError(f"options of '{named}' go after its name: nf4convert {named} [OPTIONS] ...")
                args = ["convert", *args]
        return super().parse_args(ctx, args)


def _help_of(ctx) -> str:
    """The help that lists the options of the command a usage error is about (``nf4convert batch --help``)."""
    names = []
    while ctx is not None and ctx.parent is not None:
        names.append(ctx.info_name)
        ctx = ctx.parent
    return " ".join(["nf4convert", *reversed(names), "--help"])


def _stopped_outside_a_run(stop: BaseException) -> int:
    """A stop signal that landed in click's code (which turns Ctrl-C into an Abort) or in a command before its run:
    its line and status, as a run's."""
    if isinstance(stop, click.exceptions.Abort):
        stop = stop.__cause__ or stop.__context__  # the KeyboardInterrupt (or EOFError) click caught
    if isinstance(stop, Terminated):
        signum = stop.signum
    elif isinstance(stop, KeyboardInterrupt):
        signum = signal.SIGINT
    else:
        error_line("aborted")
        return 1
    error_line(f"{'interrupted' if signum == signal.SIGINT else 'terminated'}; nothing was written")
    return 128 + signum


def _exit_code(exiting: SystemExit) -> int:
    """The status ``sys.exit(value)`` gives the process: None is 0, an int itself, anything else printed and 1."""
    if exiting.code is None or isinstance(exiting.code, int):
        return exiting.code or 0
    print(exiting.code, file=sys.stderr)
    return 1


def _exit_now(code: int) -> None:
    """End the run, finished or failed, without the interpreter's teardown: with torch (and CUDA) loaded, destructors,
    the CUDA context and pinned memory take a while to unwind, for nothing (every file is closed and in place, or
    removed, by now), and a Ctrl-C in that time would print a traceback from torch's exit callbacks. Every run ends
    so, with torch or without: one way out."""
    import os

    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:  # None: the stream was closed when the process started (>&-)
                stream.flush()
        except (
            OSError,
            ValueError,
        ):  # a closed pipe (| head), a full device or a closed stream: nothing more can reach it
            pass
    os._exit(code)


def _refuse_mistyped_command(word: str, commands: list[str]) -> None:
    """A first word that is no folder, no repo id and close to a command is a typo, not a SOURCE."""
    import difflib

    from ..hub.names import looks_like_repo_id
    from ..paths import expanded

    try:
        if expanded(word, "source").exists() or looks_like_repo_id(word):
            return
    except ArgumentError:
        return  # a ~user with no such user: a SOURCE, whose resolution says so
    close = difflib.get_close_matches(word, commands, n=1, cutoff=0.6)
    if close:
        raise click.UsageError(f"no such command '{word}'; did you mean {close[0]}?")


def error_line(text: str) -> None:
    """The one way an error reaches the terminal: ``Error: ...`` on one line, whatever the text holds (a path
    or tensor name with a newline or carriage return in it is shown escaped, a byte that is not UTF-8 as ``\\xNN``)."""
    one_line = as_utf8(text).replace("\r", "\\r").replace("\n", "\\n")
    try:
        click.echo(f"Error: {one_line}", err=True)
    except BrokenPipeError:
        _reader_gone(sys.stderr)  # nobody reads standard error any more: the exit status says it


def fail(text: str, code: int = 1):
    error_line(text)
    sys.exit(code)


def _command() -> _Command:
    return click.get_current_context().obj


def _stopped(stop: BaseException | None, signum: int, kept=None):
    """A stop signal's line and exit: what was partly written is gone by now; an OUT that was complete before the
    signal could act (``kept``, or the stop's ``output_complete``) is named. The process ends without the interpreter's
    teardown, which would wait for any worker thread still running."""
    word = "interrupted" if signum == signal.SIGINT else "terminated"
    complete = getattr(stop, "output_complete", None) or kept
    left = getattr(stop, "left", None)  # a staging folder that could not be removed
    note = getattr(stop, "pushed", None)  # a push with no local copy stopped: what it kept on the Hub, how to finish
    if note and left is None:
        error_line(f"{word}; {note}")
    elif complete:
        error_line(f"{word}; {complete} was complete and is kept")
    elif left is not None:
        error_line(f"{word}; {left} is left (it could not be removed): remove it with: rm -rf {shlex.quote(str(left))}")
    elif stop is None:  # the exception was swallowed where it was raised (a destructor): the work ran to its end
        error_line(f"{word} as the work finished")
    else:
        error_line(f"{word}; nothing was written")
    end(128 + signum)


def end(code: int):
    if _command().process:
        _exit_now(code)
    sys.exit(code)


def say(text: str, *, err: bool = False) -> None:
    """A line on standard output (or error); one that cannot be printed (a full device, a closed stream) is an
    error line on the other stream, not a traceback. A stream whose reader went away (``| head``) takes no more lines,
    silently, and the command runs to its end and its own status, as standard tools do."""
    try:
        click.echo(text, err=err)
    except BrokenPipeError:
        _reader_gone(sys.stderr if err else sys.stdout)
    except OSError as error:
        stream = "standard error" if err else "standard output"
        if not err:
            error_line(f"cannot print to {stream} ({error.strerror or error})")
        sys.exit(1)


def _reader_gone(stream) -> None:
    """What is written to ``stream`` from now on goes nowhere, its unsent lines too (Python's recipe for a closed
    pipe): no error at the next line or at the exit's flush."""
    import os

    try:
        nowhere = os.open(os.devnull, os.O_WRONLY)
        os.dup2(nowhere, stream.fileno())
        os.close(nowhere)
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's stream): nothing to redirect
        pass


def message(error) -> str:
    """A library error's line, with the flag that would change the outcome. A message that names its option as the API
    spells it (``max_shard_size``) names the command line's flag (``--max-shard-size``) instead."""
    option = getattr(error, "option", None) or ""
    declared = every_option().get(option)
    text, hint = str(error), declared.error_hint if declared is not None else None
    flag = _flag(option) if "_" in option else None  # a name without "_" is the flag's own word, and a plain word too
    if flag is not None and re.search(rf"(?<![\w-]){option}(?!\w)", text):
        text = re.sub(rf"(?<![\w-]){option}(?!\w)", flag, text)
        hint = None if hint == f"see {flag}" else hint
    return f"{text} ({hint})" if hint else text


def _flag(option: str) -> str | None:
    """The flag of this command that sets the API's ``option`` (None: it has none)."""
    context = click.get_current_context(silent=True)
    for param in context.command.get_params(context) if context is not None else ():
        if param.name == option:
            return max(param.opts, key=len)
    return None


def run_action(action, *, stops_reported: bool = False, kept=lambda: None):
    """Run ``action``; user mistakes and bad input become one line and a non-zero exit. ``stops_reported``: the action
    reports the stop signals it met itself (a batch's table); ``kept()``: the output the action completed, if any."""
    try:
        result = action()
    except (Interrupted, KeyboardInterrupt) as stop:
        _stopped(stop, signal.SIGINT)
    except Terminated as stop:
        _stopped(stop, stop.signum)
    except Nf4ConvertError as error:
        fail(message(error), 2 if isinstance(error, ArgumentError) else 1)  # a bad option value is a usage error
    received = _command().stops.received
    if received and not stops_reported:  # a stop signal whose exception a destructor swallowed: still a stopped run
        _stopped(None, received[0], kept())
    return result
