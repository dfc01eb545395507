"""The command line: parsing and messages only; the work is in conversion.py and verification.py.

torch, Triton and bitsandbytes are imported inside the commands, so ``--help`` and argument errors are
instant. Every failure is one ``Error:`` line and a non-zero exit: 1 for bad input or a failed run, 2 for
a usage error, 130 for Ctrl-C, 143 for SIGTERM and 129 for SIGHUP (each removes what was partly written).
"""

from __future__ import annotations

import signal
import sys
import threading
from functools import partial

import click

from . import __version__
from .dtypes import OUTPUT_CHOICES
from .output import STOP_SIGNALS

DEFAULT_SHARD_SIZE = "5GB"  # plan.DEFAULT_SHARD_SIZE (plan imports what --help must not); a test checks they agree

# What a library error's ``option`` becomes on the command line.
HINTS = {
    "overwrite": "pass --overwrite to replace it",
    "token": "pass --token or set HF_TOKEN",
    "revision": "see --revision",
    "dtype": "see --dtype",
    "device": "see --device",
    "max_shard_size": "see --max-shard-size",
    "adapter": "see --adapter",
}
# output.STOP_SIGNALS stop a run: SIGINT as KeyboardInterrupt, SIGTERM and SIGHUP as Terminated; each exits 128 + its
# number once what was partly written is removed.
_received: list = []  # the stop signals this command received
_process = [False]  # running as the process's own command line (not a test's CliRunner)
_running = [False]  # a command is running: a signal deferred out of an import is sent again only then
_resend = threading.Lock()  # a resend and the end of the command (handlers restored) never interleave
_written: list = [None]  # the OUT this command completed: a later stop (in --verify, the push) keeps it


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread so that cleanup runs as for Ctrl-C."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = signum


def _inside_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _unraisable(previous, unraisable) -> None:
    """A stop signal raised in a destructor or weakref callback, which Python cannot propagate: not printed as a
    traceback; ``_run`` reports the signal (``_received``) when the command returns."""
    if not isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated)):
        previous(unraisable)


def _on_signal(signum, frame):
    """Stop the main thread with KeyboardInterrupt (SIGINT) or Terminated, but never inside an import: an exception
    raised in importlib's own code can leave a module's import lock held, and a thread importing that module then
    waits forever (the run hung on Ctrl-C that way). There the signal is sent again 50 ms later."""
    _received.append(signum)
    if not _running[0]:
        return  # the command is over (a resend raced its end): nothing left to stop
    if _inside_import(frame) and hasattr(signal, "pthread_kill"):
        timer = threading.Timer(0.05, _send_again, (threading.main_thread().ident, signum))
        timer.daemon = True  # never holds up the exit
        timer.start()
        return
    raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)


def _send_again(thread: int, signum: int) -> None:
    with _resend:
        if _running[0]:
            signal.pthread_kill(thread, signum)


class DefaultGroup(click.Group):
    """``nf4convert SOURCE ...`` means ``nf4convert convert SOURCE ...``; usage errors are one line."""

    def main(self, args=None, *rest, **kwargs):
        kwargs.pop("standalone_mode", None)
        process = args is None  # the process's own command line (not a test's CliRunner)
        args = sys.argv[1:] if args is None else list(args)
        if not args:
            args = ["--help"]
        # A signal the caller ignores (nohup, trap '' INT) stays ignored.
        previous = {number: signal.signal(number, _on_signal) for number in STOP_SIGNALS
                    if signal.getsignal(number) is not signal.SIG_IGN}  # fmt: skip
        _received.clear()
        _process[0], _running[0], _written[0] = process, True, None
        unraisable_hook, sys.unraisablehook = sys.unraisablehook, partial(_unraisable, sys.unraisablehook)
        try:
            try:
                code = super().main(args, *rest, standalone_mode=False, **kwargs)
                code = code if isinstance(code, int) else 0
            except click.ClickException as error:  # a bad option or argument: one line, not the usage text
                error_line(f"{error.format_message()} (see 'nf4convert --help')")
                code = error.exit_code
            except click.exceptions.Abort:
                error_line("aborted")
                code = 1
            except SystemExit as exiting:  # a failed run (_fail, a failed verify or batch) ends as a finished one does
                code = _exit_code(exiting)
            if process:
                with _resend:
                    _running[0] = False  # our handlers stay: a stop signal from here on is recorded, not raised
                _exit_now(code)
        finally:
            with _resend:
                _running[0] = False
                for number, handler in previous.items():
                    signal.signal(number, handler)
            sys.unraisablehook = unraisable_hook
        sys.exit(code)

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            _refuse_mistyped_command(args[0], list(self.commands))
            args = ["convert", *args]
        elif args and args[0].startswith("-"):  # convert's options before SOURCE (nf4convert -q SOURCE, -- SOURCE)
            own = {name for param in self.get_params(ctx) for name in (*param.opts, *param.secondary_opts)}
            if args[0].split("=", 1)[0] not in own:
                from pathlib import Path

                named = next((word for word in args if word in self.commands and word != "convert"
                              and not Path(word).exists()), None)  # fmt: skip
                if named is not None:
                    raise click.UsageError(f"options of '{named}' go after its name: nf4convert {named} [OPTIONS] ...")
                args = ["convert", *args]
        return super().parse_args(ctx, args)


def _exit_code(exiting: SystemExit) -> int:
    """The status ``sys.exit(value)`` gives the process: None is 0, an int itself, anything else printed and 1."""
    if exiting.code is None or isinstance(exiting.code, int):
        return exiting.code or 0
    print(exiting.code, file=sys.stderr)
    return 1


def _exit_now(code: int) -> None:
    """End the run, finished or failed, without the interpreter's teardown: with torch (and CUDA) loaded,
    destructors, the CUDA context and pinned memory take ~0.5 s to unwind, for nothing (every file is closed and in
    place, or removed, by now), and a Ctrl-C in that time would print a traceback from torch's exit callbacks.
    Every run ends so, with torch or without (the CPU route runs without it): one way out."""
    import os

    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:  # None: the stream was closed when the process started (>&-)
                stream.flush()
        except (OSError, ValueError):  # a closed pipe (| head), a full device or a closed stream: nothing more can reach it
            pass
    os._exit(code)


def _refuse_mistyped_command(word: str, commands: list[str]) -> None:
    """A first word that is no folder, no repo id and close to a command is a typo, not a SOURCE."""
    import difflib

    from .errors import ArgumentError
    from .hub import looks_like_repo_id
    from .paths import expanded

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
    or tensor name with a newline or carriage return in it is shown escaped)."""
    one_line = text.replace("\r", "\\r").replace("\n", "\\n")
    click.echo(f"Error: {one_line}", err=True)


def _fail(text: str, code: int = 1):
    error_line(text)
    sys.exit(code)


def _stopped(stop: BaseException | None, signum: int):
    """A stop signal's line and exit: what was partly written is gone by now; an OUT that was complete before the
    signal could act is kept and named. The process ends without the interpreter's teardown, which would wait
    for any worker thread still running."""
    word = "interrupted" if signum == signal.SIGINT else "terminated"
    complete = getattr(stop, "output_complete", None) or _written[0]
    if complete:
        error_line(f"{word}; {complete} was complete and is kept")
    elif stop is None:  # the exception was swallowed where it was raised (a destructor): the work ran to its end
        error_line(f"{word} as the work finished")
    else:
        error_line(f"{word}; nothing was written")
    if _process[0]:
        _exit_now(128 + signum)
    sys.exit(128 + signum)


def say(text: str, *, err: bool = False) -> None:
    """A line on standard output (or error); one that cannot be printed (a full device, a closed stream) is an
    error line on the other stream, not a traceback."""
    try:
        click.echo(text, err=err)
    except OSError as error:
        stream = "standard error" if err else "standard output"
        if not err:
            error_line(f"cannot print to {stream} ({error.strerror or error})")
        sys.exit(1)


def message(error) -> str:
    """A library error's line, with the flag that would change the outcome."""
    hint = HINTS.get(getattr(error, "option", None) or "")
    return f"{error} ({hint})" if hint else str(error)


def _run(action):
    """Run ``action``; user mistakes and bad input become one line and a non-zero exit."""
    from .errors import Nf4ConvertError

    try:
        result = action()
    except KeyboardInterrupt as stop:
        _stopped(stop, signal.SIGINT)
    except Terminated as stop:
        _stopped(stop, stop.signum)
    except Nf4ConvertError as error:
        from .errors import ArgumentError

        _fail(message(error), 2 if isinstance(error, ArgumentError) else 1)  # a bad option value is a usage error
    if _received:  # a stop signal whose exception a destructor swallowed: still a stopped run
        _stopped(None, _received[0])
    return result


@click.group(cls=DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nf4convert")
def main():
    """Turn bitsandbytes checkpoints (4-bit NF4/FP4, 8-bit LLM.int8) into dense safetensors checkpoints.

    \b
    Examples:
      nf4convert unsloth/Llama-3.2-1B-Instruct-bnb-4bit            # -> ./Llama-3.2-1B-Instruct-bf16
      nf4convert ./my-model-bnb-4bit -o my-model-fp16 --dtype fp16
      nf4convert verify my-model-fp16 ./my-model-bnb-4bit
      nf4convert batch org/a-bnb-4bit org/b-bnb-4bit -o converted/
    """


def _quiet(ctx, param, value) -> bool:
    return value or sys.stderr is None  # no standard error (closed at start): no bars to draw on it


def _common_source_options(function):
    for option in reversed([
        click.option("--revision", help="Hub branch, tag or commit of SOURCE (default: main; not for a local folder)."),
        click.option("--token", envvar="HF_TOKEN", help="Hub token for private or gated repos (default: $HF_TOKEN)."),
        click.option("--cache-dir", type=click.Path(file_okay=False), help="Hub cache folder (default: $HF_HUB_CACHE)."),
    ]):  # fmt: skip
        function = option(function)
    return function


ADAPTER_HELP = "A peft LoRA adapter (folder or Hub repo id) to merge into the weights, bit for bit as peft merges."


def _one_adapter(ctx, param, values):
    """--adapter given once at most: click would keep the last of several and drop the others unsaid."""
    if len(values) > 1:
        raise click.BadParameter(f"given {len(values)} times; one adapter per conversion (merge several into one "
                                 "with peft first)")  # fmt: skip
    return values[0] if values else None


def _convert_options(function):
    for option in reversed([
        click.option("--adapter", multiple=True, callback=_one_adapter, help=ADAPTER_HELP),
        click.option("--dtype", type=click.Choice(OUTPUT_CHOICES, case_sensitive=False), default="auto", show_default=True,
                     help="Output dtype; auto keeps the dtype the model was quantized from."),
        click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N (auto: the GPU if there is one)."),
        click.option("--max-shard-size", default=DEFAULT_SHARD_SIZE, show_default=True, help="Largest output shard, like transformers'."),
        click.option("--overwrite", is_flag=True, help="Replace OUT if it exists (only once the new output is complete)."),
        click.option("-q", "--quiet", is_flag=True, callback=_quiet,
                     help="No progress bars (downloads and uploads too); the one-line summary stays."),
    ]):  # fmt: skip
        function = option(function)
    return _common_source_options(function)


def _summary(result) -> str:
    return (f"{result.output}: {result.tensors} tensors ({result.dequantized} dequantized), "
            f"{result.bytes / 1e9:.2f} GB {result.dtype}, {result.seconds:.1f} s")  # fmt: skip


@main.command("convert")
@click.argument("source")
@click.option("-o", "--output", type=click.Path(), help="Output folder (default: ./<name>-<dtype>).")
@_convert_options
@click.option("--dry-run", is_flag=True, help="Print the plan (tensors, dtype, shards, bytes, free space); write nothing "
              "(of a Hub SOURCE only the headers and quant states of its weight files are read, by range requests).")
@click.option("--verify", "then_verify", is_flag=True, help="Verify the output against SOURCE right after converting.")
@click.option("--push-to-hub", "push_to", metavar="REPO_ID", help="Upload the finished output to this Hub repo (after --verify, if asked); "
              "weight files at the repo's root that the output lacks are deleted in the same commit.")
@click.option("--private", is_flag=True, help="With --push-to-hub: create the repo private (an existing public one is refused).")
@click.option("--push-branch", metavar="BRANCH", help="With --push-to-hub: the branch to upload to (created if missing; default main).")
def convert_command(source, output, adapter, dtype, device, max_shard_size, overwrite, quiet, revision, token, cache_dir,
                    dry_run, then_verify, push_to, private, push_branch):  # fmt: skip
    """Convert SOURCE (a Hub repo id, a local folder, or a repo in the Hub cache).

    \b
    Memory stays at a few tensors' worth, whatever the model size; the output is written to a
    temporary folder beside OUT and renamed into place only when complete.
    \b
    Examples:
      nf4convert convert unsloth/Qwen2.5-0.5B-Instruct-bnb-4bit --dtype bf16
      nf4convert convert ./local-bnb-4bit -o dense --max-shard-size 2GB --device cpu --verify
      nf4convert convert ./local-bnb-4bit --adapter ./my-qlora-adapter -o merged
      nf4convert convert ./my-qlora-adapter          # an adapter alone: merged into the base it names
      nf4convert convert ./local-bnb-4bit --dry-run
      nf4convert convert org/model-bnb-4bit --verify --push-to-hub me/model-bf16 --private
    """
    if (private or push_branch) and not push_to:
        _fail("--private and --push-branch go with --push-to-hub REPO_ID", 2)
    if dry_run and (then_verify or push_to):
        _fail("--dry-run writes nothing, so there is nothing to --verify or --push-to-hub", 2)
    if push_to:
        from .errors import ArgumentError
        from .upload import check_target

        try:
            check_target(push_to, push_branch)
        except ArgumentError as error:
            _fail(f"--{error.option.replace('_', '-')}: {error}", 2)
    options = dict(dtype=dtype, adapter=adapter, revision=revision, token=token, cache_dir=cache_dir, max_shard_size=max_shard_size,
                   overwrite=overwrite)  # fmt: skip

    def action():
        if dry_run:
            from .conversion import prepare
            from .devices import pick_device

            pick_device(device)  # what the conversion would refuse, the dry run refuses too
            for line in _plan_lines(prepare(source, output, progress=not quiet, headers_only=True, **options)):
                say(line)
            return True
        from .conversion import convert

        result = convert(source, output, device=device, progress=not quiet, **options)
        _written[0] = result.output  # complete: a stop from here on (--verify, the push) leaves it
        say(_summary(result))
        for warning in result.warnings:
            say(f"Warning: {warning}", err=True)
        if then_verify and not _verify(result.output, source, device=device, adapter=adapter, quiet=quiet, revision=revision,
                                       token=token, cache_dir=cache_dir):  # fmt: skip
            if push_to:
                error_line(f"verification failed; {result.output} was not pushed to {push_to}")
            return False
        if push_to:
            from .upload import push_to_hub

            url = push_to_hub(result.output, push_to, private=private, token=token, revision=push_branch, progress=not quiet)
            say(f"pushed to {url}")
        return True

    if not _run(action):
        sys.exit(1)


def _plan_lines(prepared) -> list[str]:
    plan = prepared.plan
    needed = plan.tensor_bytes + plan.side_bytes
    from collections import Counter

    kinds = Counter(tensor.recipe.label for tensor in plan.tensors)
    shown = f"{prepared.headers_only} (its headers and quant states read from the Hub; no weights downloaded)"
    lines = [f"source: {shown if prepared.headers_only else plan.folder}", f"output: {prepared.output} ({plan.dtype.name})",
             f"tensors: {len(plan.tensors)} (" + ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) + ")"]  # fmt: skip
    lines += [f"  {shard.filename}: {len(shard.tensors)} tensors, {shard.nbytes / 1e9:.3f} GB" for shard in plan.shards]
    lines.append(f"side files: {len(plan.side_files)} ({plan.side_bytes / 1e6:.1f} MB), config.json {'rewritten' if plan.config else 'none'}")
    lines.append(f"to write: {needed / 1e9:.3f} GB; free where it goes: {_space_verdict(prepared.free_bytes, needed)}")
    lines.append("dry run: nothing was written")
    return lines


def _space_verdict(free: int, needed: int) -> str:
    """A dry run's word on the free space, by the conversion's own rule (output.space_needed: the bytes and headroom)."""
    from .output import space_needed, size_text

    verdict = "enough" if free >= space_needed(needed) else f"NOT enough: {size_text(space_needed(needed))} needed with headroom"
    return f"{size_text(free)} ({verdict})"


def _verify(output, source, *, device, adapter, quiet, revision, token, cache_dir) -> bool:
    from .hub import progress_bars
    from .verification import report_lines, verify

    with progress_bars(not quiet):  # the downloads' bars too
        report = verify(output, source, device=device, adapter=adapter, revision=revision, token=token,
                        cache_dir=cache_dir, progress=not quiet)  # fmt: skip
    for line in report_lines(report):
        say(line)
    return report.ok


@main.command("verify")
@click.argument("output", type=click.Path())
@click.argument("source")
@click.option("--device", default="auto", show_default=True, help="Where bitsandbytes dequantizes: auto, cpu, cuda, cuda:N.")
@click.option("--adapter", multiple=True, callback=_one_adapter,
              help="The LoRA adapter that was merged (peft merges it again for the check).")
@click.option("-q", "--quiet", is_flag=True, callback=_quiet, help="No progress bars (downloads too).")
@_common_source_options
def verify_command(output, source, device, adapter, quiet, revision, token, cache_dir):
    """Check OUTPUT against SOURCE with bitsandbytes' own dequantization, bit for bit.

    Exits 0 only if every weight matches, every source tensor is there and no quantization
    key or config remains.

    \b
    Example:
      nf4convert verify Llama-3.2-1B-Instruct-bf16 unsloth/Llama-3.2-1B-Instruct-bnb-4bit
    """
    if not _run(lambda: _verify(output, source, device=device, adapter=adapter, quiet=quiet, revision=revision, token=token,
                                cache_dir=cache_dir)):  # fmt: skip
        sys.exit(1)


@main.command("batch")
@click.argument("sources", nargs=-1)
@click.option("-o", "--output-root", "output_root", type=click.Path(file_okay=False), required=True,
              help="Folder that receives one <name>-<dtype> folder per source.")  # fmt: skip
@click.option("--from-file", type=click.File("r", encoding="utf-8-sig"),
              help="Read more sources from this file, one per line ('#' at a line's start or after a space begins a comment).")
@_convert_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per source (a line each) instead of the table.")
@click.option("--dry-run", is_flag=True, help="Plan every source (status 'planned') and write nothing; Hub sources as "
              "convert --dry-run reads them, without their weights.")
def batch_command(sources, output_root, from_file, adapter, dtype, device, max_shard_size, overwrite, quiet, revision,
                  token, cache_dir, as_json, dry_run):  # fmt: skip
    """Convert several SOURCES into OUTPUT_ROOT; keep going when one fails, then print a table.

    Two sources with the same name get outputs named after their owners too (orgA--x-bf16, orgB--x-bf16).
    A failed source's output is the folder it was to be written to (<name>-<dtype> where its dtype was not
    decided). Exits 1 if any failed, 130 on Ctrl-C and 143 on SIGTERM (naming the sources not attempted).
    With --dry-run each source is only planned, and the bytes all of them would write are set against the free space.

    \b
    Example:
      nf4convert batch org/a-bnb-4bit ./b-bnb-4bit -o converted/ --dtype bf16
      nf4convert batch --from-file models.txt -o converted/ --json
      nf4convert batch --from-file models.txt -o converted/ --dry-run
    """
    import json
    import re
    import time

    sources = list(sources)
    if from_file is not None:
        try:
            lines = from_file.read().splitlines()
        except UnicodeDecodeError as error:
            _fail(f"--from-file {from_file.name}: not UTF-8 text (byte {error.start}: {error.reason})", 2)
        # '#' begins a comment at a line's start or after whitespace only: one inside a path (h#1/x) is the path's
        listed = [re.sub(r"(?:^|\s)#.*", "", line).strip() for line in lines]
        sources += [source for source in listed if source]
    if not sources:
        _fail("no sources given (name them, or pass --from-file)", 2)

    def outputs():
        from . import knobs
        from .conversion import batch_output, batch_stems, check_batch_root

        knobs.check()  # once, before any source (each would fail alike)
        check_batch_root(output_root, [*sources, adapter])
        return [(stem, batch_output(output_root, stem, dtype)) for stem in batch_stems(sources)]

    rows, stopped, needed, free = [], None, 0, None
    done = "planned" if dry_run else "ok"
    for source, (stem, planned) in zip(sources, _run(outputs)):
        started = time.perf_counter()
        row = {"source": source, "output": planned, "status": "failed", "error": None, "tensors": None, "bytes": None,
               "seconds": None}  # fmt: skip
        try:
            from .conversion import convert, prepare

            options = dict(dtype=dtype, adapter=adapter, revision=revision, token=token, cache_dir=cache_dir,
                           max_shard_size=max_shard_size, overwrite=overwrite, progress=not quiet and not as_json,
                           output_dir=output_root, stem=stem)  # fmt: skip
            if dry_run:
                from .devices import pick_device

                pick_device(device)  # what the conversion would refuse, the dry run refuses too
                prepared = prepare(source, headers_only=True, **options)
                plan = prepared.plan
                row.update(output=str(prepared.output), status=done, tensors=len(plan.tensors), bytes=plan.tensor_bytes)
                needed += plan.tensor_bytes + plan.side_bytes
                free = prepared.free_bytes
            else:
                result = convert(source, device=device, **options)
                row.update(output=str(result.output), status=done, tensors=result.tensors, bytes=result.bytes)
                for warning in result.warnings:
                    say(f"Warning: {source}: {warning}", err=True)
        except (KeyboardInterrupt, Terminated) as stop:
            row.update(status="interrupted", error="interrupted", output=str(getattr(stop, "output_planned", None) or planned))
            stopped = stop
            if getattr(stop, "output_complete", None):
                row.update(output=str(stop.output_complete), status="ok")
        except Exception as error:  # noqa: BLE001  (one source's failure, whatever it is, must not stop the others)
            from .errors import Nf4ConvertError

            row["error"] = message(error) if isinstance(error, Nf4ConvertError) else f"internal error: {type(error).__name__}: {error}"
            row["output"] = str(getattr(error, "output_planned", None) or planned)
            if not as_json:
                error_line(row["error"])
        row["seconds"] = round(time.perf_counter() - started, 1)
        rows.append(row)
        if stopped is not None:
            break
    untried = sources[len(rows) :]
    rows += [{"source": s, "output": None, "status": "not attempted", "error": None, "tensors": None, "bytes": None, "seconds": None}
             for s in untried]  # fmt: skip
    if as_json:
        for row in rows:
            say(json.dumps(row))
    else:
        _table(rows)
    failed = sum(row["status"] != done for row in rows)
    if dry_run and stopped is None:
        if free is not None:
            say(f"to write: {needed / 1e9:.3f} GB for {len(rows) - failed} planned; free where it goes: "
                f"{_space_verdict(free, needed)}", err=as_json)  # fmt: skip
        say("dry run: nothing was written", err=as_json)
    if stopped is not None:
        names = ", ".join(untried) if untried else "none"
        signum = stopped.signum if isinstance(stopped, Terminated) else signal.SIGINT
        error_line(f"{'terminated' if isinstance(stopped, Terminated) else 'interrupted'}; not attempted: {names}")
        if _process[0]:
            _exit_now(128 + signum)
        sys.exit(128 + signum)
    if failed:
        say(f"{failed} of {len(sources)} failed", err=True)
        sys.exit(1)


def _table(rows) -> None:
    header = ("source", "status", "output", "tensors", "size", "seconds")
    cells = [header] + [(row["source"], row["status"], row["output"] or "-", str(row["tensors"] or "-"),
                         f"{row['bytes'] / 1e9:.2f} GB" if row["bytes"] is not None else "-",
                         f"{row['seconds']:.1f}" if row["seconds"] is not None else "-") for row in rows]  # fmt: skip
    widths = [max(len(cell[i]) for cell in cells) for i in range(len(header))]
    for cell in cells:
        say("  ".join(value.ljust(width) for value, width in zip(cell, widths)).rstrip())


if __name__ == "__main__":
    main()
