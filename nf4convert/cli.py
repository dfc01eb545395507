"""The command line: parse, call the API (``run.py``), render results (``render.py``) and errors.

Every failure is one ``Error:`` line and a non-zero exit: 1 for bad input or a failed run, 2 for a usage error, 130 for
Ctrl-C, 143 for SIGTERM and 129 for SIGHUP (each removes what was partly written). The API is imported inside the
commands (it brings numpy, and with it seconds of start-up where torch follows), so ``--help`` and argument errors
are instant.
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import dataclass

import click

from . import __version__
from .dtypes import OUTPUT_CHOICES
from .errors import ArgumentError, Interrupted, Nf4ConvertError, Terminated
from .gguf_converter import GGUF_TYPES
from .signals import StopSignals
from .sizes import DEFAULT_SHARD_SIZE

# What a library error's ``option`` becomes on the command line.
HINTS = {
    "overwrite": "pass --overwrite to replace it",
    "token": "pass --token or set HF_TOKEN",
    "revision": "see --revision",
    "dtype": "see --dtype",
    "device": "see --device",
    "max_shard_size": "see --max-shard-size",
    "adapter": "see --adapter",
    "gguf_type": "see --gguf-type",
}


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
        with StopSignals() as stops:
            try:
                code = super().main(args, *rest, standalone_mode=False, obj=_Command(stops, process), **kwargs)
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
                stops.finish()
                _exit_now(code)
        sys.exit(code)

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


def _command() -> _Command:
    return click.get_current_context().obj


def _stopped(stop: BaseException | None, signum: int, kept=None):
    """A stop signal's line and exit: what was partly written is gone by now; an OUT that was complete before the
    signal could act (``kept``, or the stop's ``output_complete``) is named. The process ends without the interpreter's
    teardown, which would wait for any worker thread still running."""
    word = "interrupted" if signum == signal.SIGINT else "terminated"
    complete = getattr(stop, "output_complete", None) or kept
    if complete:
        error_line(f"{word}; {complete} was complete and is kept")
    elif stop is None:  # the exception was swallowed where it was raised (a destructor): the work ran to its end
        error_line(f"{word} as the work finished")
    else:
        error_line(f"{word}; nothing was written")
    _end(128 + signum)


def _end(code: int):
    if _command().process:
        _exit_now(code)
    sys.exit(code)


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


def _run(action, *, stops_reported: bool = False, kept=lambda: None):
    """Run ``action``; user mistakes and bad input become one line and a non-zero exit. ``stops_reported``: the action
    reports the stop signals it met itself (a batch's table); ``kept()``: the output the action completed, if any."""
    try:
        result = action()
    except (Interrupted, KeyboardInterrupt) as stop:
        _stopped(stop, signal.SIGINT)
    except Terminated as stop:
        _stopped(stop, stop.signum)
    except Nf4ConvertError as error:
        _fail(message(error), 2 if isinstance(error, ArgumentError) else 1)  # a bad option value is a usage error
    received = _command().stops.received
    if received and not stops_reported:  # a stop signal whose exception a destructor swallowed: still a stopped run
        _stopped(None, received[0], kept())
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
    for option in reversed(
        [
            click.option(
                "--revision", help="Hub branch, tag or commit of SOURCE (default: main; not for a local folder)."
            ),
            click.option(
                "--token", envvar="HF_TOKEN", help="Hub token for private or gated repos (default: $HF_TOKEN)."
            ),
            click.option(
                "--cache-dir", type=click.Path(file_okay=False), help="Hub cache folder (default: $HF_HUB_CACHE)."
            ),
        ]
    ):
        function = option(function)
    return function


ADAPTER_HELP = "A peft LoRA adapter (folder or Hub repo id) to merge into the weights, bit for bit as peft merges."


def _one_adapter(ctx, param, values):
    """--adapter given once at most: click would keep the last of several and drop the others unsaid."""
    if len(values) > 1:
        raise click.BadParameter(
            f"given {len(values)} times; one adapter per conversion (merge several into one with peft first)"
        )
    return values[0] if values else None


def _convert_options(function):
    for option in reversed(
        [
            click.option("--adapter", multiple=True, callback=_one_adapter, help=ADAPTER_HELP),
            click.option(
                "--dtype",
                type=click.Choice(OUTPUT_CHOICES, case_sensitive=False),
                default="auto",
                show_default=True,
                help="Output dtype; auto keeps the dtype the model was quantized from.",
            ),
            click.option(
                "--gguf-type",
                type=click.Choice(GGUF_TYPES, case_sensitive=False),
                help="Write one GGUF file of this type, as llama.cpp's converter writes it from the dense output "
                "(default with a .gguf OUT: the --dtype's own float type).",
            ),
            click.option(
                "--device",
                default="auto",
                show_default=True,
                help="auto, cpu, cuda or cuda:N (auto: the GPU if there is one).",
            ),
            click.option(
                "--max-shard-size",
                default=DEFAULT_SHARD_SIZE,
                show_default=True,
                help="Largest output shard, like transformers'.",
            ),
            click.option(
                "--overwrite", is_flag=True, help="Replace OUT if it exists (only once the new output is complete)."
            ),
            click.option(
                "-q",
                "--quiet",
                is_flag=True,
                callback=_quiet,
                help="No progress bars (downloads and uploads too); the one-line summary stays.",
            ),
        ]
    ):
        function = option(function)
    return _common_source_options(function)


def _summary(result) -> str:
    return (
        f"{result.output}: {result.tensors} tensors ({result.dequantized} dequantized), "
        f"{result.bytes / 1e9:.2f} GB {result.dtype}, {result.seconds:.1f} s"
    )


@main.command("convert")
@click.argument("source")
@click.option(
    "-o",
    "--output",
    type=click.Path(),
    help="Output folder (default: ./<name>-<dtype>), or one GGUF file: a name ending in .gguf.",
)
@_convert_options
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan (tensors, dtype, shards, bytes, free space); write nothing "
    "(of a Hub SOURCE only the headers and quant states of its weight files are read, by range requests).",
)
@click.option("--verify", "then_verify", is_flag=True, help="Verify the output against SOURCE right after converting.")
@click.option(
    "--push-to-hub",
    "push_to",
    metavar="REPO_ID",
    help="Upload the finished output to this Hub repo (after --verify, if asked); "
    "weight files at the repo's root that the output lacks are deleted in the same commit.",
)
@click.option(
    "--private", is_flag=True, help="With --push-to-hub: create the repo private (an existing public one is refused)."
)
@click.option(
    "--push-branch",
    metavar="BRANCH",
    help="With --push-to-hub: the branch to upload to (created if missing; default main).",
)
def convert_command(
    source,
    output,
    adapter,
    dtype,
    gguf_type,
    device,
    max_shard_size,
    overwrite,
    quiet,
    revision,
    token,
    cache_dir,
    dry_run,
    then_verify,
    push_to,
    private,
    push_branch,
):
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
      nf4convert convert ./local-bnb-4bit --adapter ./my-qlora-adapter -o model-q8_0.gguf --gguf-type q8_0
    """
    if (private or push_branch) and not push_to:
        _fail("--private and --push-branch go with --push-to-hub REPO_ID", 2)
    if dry_run and (then_verify or push_to):
        _fail("--dry-run writes nothing, so there is nothing to --verify or --push-to-hub", 2)
    if push_to:
        from .upload import check_target

        try:
            check_target(push_to, push_branch)
        except ArgumentError as error:
            _fail(f"--{error.option.replace('_', '-')}: {error}", 2)
    options = dict(
        dtype=dtype,
        adapter=adapter,
        revision=revision,
        token=token,
        cache_dir=cache_dir,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        **({"gguf_type": gguf_type.lower()} if gguf_type else {}),
    )
    converted = []  # the output, once complete

    def action():
        from . import render, run

        if dry_run:
            for line in render.plan_lines(
                run.dry_run_plan(source, output, device=device, progress=not quiet, **options)
            ):
                say(line)
            return True

        def show(result) -> None:
            if isinstance(result, run.ConvertResult):
                converted.append(result.output)
                say(render.summary(result))
                for warning in result.warnings:
                    say(f"Warning: {warning}", err=True)
            elif isinstance(result, run.VerifyReport):
                _show_report(result)
                if not result.ok and push_to:
                    error_line(f"verification failed; {converted[0]} was not pushed to {push_to}")
            else:
                say(f"pushed to {result.url}")

        return run.convert_then(
            source,
            output,
            device=device,
            verify=then_verify,
            push_to=push_to,
            private=private,
            push_branch=push_branch,
            progress=not quiet,
            on_step=show,
            **options,
        )

    if not _run(action, kept=lambda: converted[0] if converted else None):
        sys.exit(1)


def _show_report(report) -> None:
    from .verification import report_lines

    for line in report_lines(report):
        say(line)


@main.command("verify")
@click.argument("output", type=click.Path())
@click.argument("source")
@click.option(
    "--device", default="auto", show_default=True, help="Where bitsandbytes dequantizes: auto, cpu, cuda, cuda:N."
)
@click.option(
    "--adapter",
    multiple=True,
    callback=_one_adapter,
    help="The LoRA adapter that was merged (peft merges it again for the check).",
)
@click.option(
    "--dtype",
    type=click.Choice(OUTPUT_CHOICES, case_sensitive=False),
    default="auto",
    show_default=True,
    help="For a GGUF OUTPUT: the --dtype it was converted with (its tensors' dtype before the GGUF type).",
)
@click.option("-q", "--quiet", is_flag=True, callback=_quiet, help="No progress bars (downloads too).")
@_common_source_options
def verify_command(output, source, device, adapter, dtype, quiet, revision, token, cache_dir):
    """Check OUTPUT against SOURCE with bitsandbytes' own dequantization, bit for bit.

    Exits 0 only if every weight matches, every source tensor is there and no quantization
    key or config remains. A GGUF OUTPUT is checked against llama.cpp's converter run on
    bitsandbytes' dequantization: every tensor's bytes and every metadata field.

    \b
    Example:
      nf4convert verify Llama-3.2-1B-Instruct-bf16 unsloth/Llama-3.2-1B-Instruct-bnb-4bit
      nf4convert verify Llama-3.2-1B-Instruct-q8_0.gguf unsloth/Llama-3.2-1B-Instruct-bnb-4bit
    """

    def action():
        from .run import verify_output

        report = verify_output(
            output,
            source,
            device=device,
            adapter=adapter,
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            progress=not quiet,
            **({"dtype": dtype} if dtype != "auto" else {}),
        )
        _show_report(report)
        return report.ok

    if not _run(action):
        sys.exit(1)


@main.command("batch")
@click.argument("sources", nargs=-1)
@click.option(
    "-o",
    "--output-root",
    "output_root",
    type=click.Path(file_okay=False),
    required=True,
    help="Folder that receives one <name>-<dtype> folder (with --gguf-type: <name>-<type>.gguf file) per source.",
)
@click.option(
    "--from-file",
    type=click.File("r", encoding="utf-8-sig"),
    help="Read more sources from this file, one per line ('#' at a line's start or after a space begins a comment).",
)
@_convert_options
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object per source (a line each) instead of the table."
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Plan every source (status 'planned') and write nothing; Hub sources as "
    "convert --dry-run reads them, without their weights.",
)
def batch_command(
    sources,
    output_root,
    from_file,
    adapter,
    dtype,
    gguf_type,
    device,
    max_shard_size,
    overwrite,
    quiet,
    revision,
    token,
    cache_dir,
    as_json,
    dry_run,
):
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
      nf4convert batch org/a-bnb-4bit ./b-bnb-4bit -o gguf/ --gguf-type q8_0
    """
    sources = list(sources)
    if from_file is not None:
        from .run import read_source_list

        try:
            sources += read_source_list(from_file.read())
        except UnicodeDecodeError as error:
            _fail(f"--from-file {from_file.name}: not UTF-8 text (byte {error.start}: {error.reason})", 2)
    if not sources:
        _fail("no sources given (name them, or pass --from-file)", 2)

    def failed(row, error) -> None:
        if isinstance(error, Nf4ConvertError):
            row.error = message(error)
        if not as_json:
            error_line(row.error)

    def action():
        from .run import batch

        return batch(
            sources,
            output_root,
            dtype=dtype,
            device=device,
            dry_run=dry_run,
            adapter=adapter,
            gguf_type=gguf_type.lower() if gguf_type else None,
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            progress=not quiet and not as_json,
            on_error=failed,
            on_warning=lambda source, warning: say(f"Warning: {source}: {warning}", err=True),
        )

    result = _run(action, stops_reported=True)
    if as_json:
        for row in result.rows:
            say(json.dumps(row.as_dict()))
    else:
        from .render import table

        for line in table(result.rows):
            say(line)
    if dry_run and result.stopped is None:
        from .render import space_verdict

        if result.free is not None:
            say(
                f"to write: {result.needed / 1e9:.3f} GB for {len(result.rows) - result.failed} planned; "
                f"free where it goes: "
                f"{space_verdict(result.free, result.needed)}",
                err=as_json,
            )
        say("dry run: nothing was written", err=as_json)
    if result.stopped is not None:
        untried = result.untried
        names = ", ".join(untried) if untried else "none"
        terminated = isinstance(result.stopped, Terminated)
        error_line(f"{'terminated' if terminated else 'interrupted'}; not attempted: {names}")
        _end(128 + (result.stopped.signum if terminated else signal.SIGINT))
    if result.failed:
        say(f"{result.failed} of {len(sources)} failed", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
