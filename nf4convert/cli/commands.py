"""The commands: ``convert`` (the default: ``nf4convert SOURCE``), ``verify`` and ``batch``. Each parses its options,
calls the API (``run.py``) and renders the results (``render.py``); how errors, exit codes and stop signals reach the
terminal is ``console.py``'s. The API is imported inside the commands (it brings numpy, and with it seconds of
start-up where torch follows), so ``--help`` and argument errors are instant.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys

import click

from .. import __version__
from ..errors import ArgumentError, Nf4ConvertError, Terminated
from .console import DefaultGroup, end, error_line, fail, message, run_action, say
from .flags import DeclaredCommand, conversion_flags, hub_flags, quiet_option, verify_flags


@click.group(cls=DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nf4convert")
def main():
    """Turn quantized checkpoints (bitsandbytes, GPTQ, AWQ, FP8, MXFP4, compressed-tensors, ModelOpt) into dense ones.

    \b
    Examples:
      nf4convert unsloth/Llama-3.2-1B-Instruct-bnb-4bit            # -> ./Llama-3.2-1B-Instruct-bf16
      nf4convert ./my-model-bnb-4bit -o my-model-fp16 --dtype fp16
      nf4convert verify my-model-fp16 ./my-model-bnb-4bit
      nf4convert batch org/a-bnb-4bit org/b-GPTQ-Int4 -o converted/
    """


@main.command("convert", cls=DeclaredCommand, declared=[("output", conversion_flags)])
@click.argument("source")
@click.option(
    "-o",
    "--output",
    type=click.Path(),
    help="Output folder (default: ./<name>-<dtype>), or one GGUF file: a name ending in .gguf.",
)
@quiet_option()
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
@click.option(
    "--no-local-copy",
    is_flag=True,
    help="With --push-to-hub: upload each shard as soon as it is made and delete it, committing everything in one "
    "commit at the end; at most 2 shards on local disk (beside OUT, which is never made). Run the same command again "
    "after a failure: shards the Hub holds are not made again.",
)
def convert_command(
    source,
    output,
    given,
    quiet,
    dry_run,
    then_verify,
    push_to,
    private,
    push_branch,
    no_local_copy,
):
    """Convert SOURCE (a Hub repo id, a local folder, or a repo in the Hub cache).

    \b
    Memory stays at a few tensors' worth, whatever the model size (a LoRA merge on the CPU holds
    one merged weight whole, with its fp32 delta); the output is written to a temporary folder
    beside OUT and renamed into place only when complete.
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
    if (private or push_branch or no_local_copy) and not push_to:
        fail("--private, --push-branch and --no-local-copy go with --push-to-hub REPO_ID", 2)
    if dry_run and (then_verify or (push_to and not no_local_copy)):
        fail("--dry-run writes nothing, so there is nothing to --verify or --push-to-hub", 2)
    if push_to:
        from ..hub.upload import check_target

        try:
            check_target(push_to, push_branch)
        except ArgumentError as error:
            fail(f"--{error.option.replace('_', '-')}: {error}", 2)
    converted = []  # the output, once complete

    def action():
        from ..options import ConvertOptions
        from . import render, run

        options = ConvertOptions.parse(**given, output=output, progress=not quiet)
        if dry_run:
            prepared = run.dry_run_plan(source, options, placed=not no_local_copy)
            on_disk = options.settings.push_on_disk if no_local_copy else None
            for line in render.plan_lines(prepared, on_disk):
                say(line)
            needed = prepared.sink.delivered_disk(on_disk) if no_local_copy else prepared.needed
            run.check_room(prepared.output, needed, prepared.free_bytes)
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
            options,
            verify=then_verify,
            push_to=push_to,
            private=private,
            push_branch=push_branch,
            on_step=show,
            no_local_copy=no_local_copy,
            again=shlex.join(["nf4convert", *sys.argv[1:]]),
        )

    if not run_action(action, kept=lambda: converted[0] if converted else None):
        sys.exit(1)


def _show_report(report) -> None:
    from ..verification.report import report_lines

    for line in report_lines(report):
        say(line)


@main.command("verify", cls=DeclaredCommand, declared=[(None, verify_flags), ("quiet", hub_flags)])
@click.argument("output", type=click.Path())
@click.argument("source")
@quiet_option("No progress bars (downloads too).")
def verify_command(output, source, given, quiet):
    """Check OUTPUT against SOURCE bit for bit, every weight recomputed by its format's reference library.

    The references: bitsandbytes (4-bit and 8-bit), GPTQModel's arithmetic (GPTQ, AWQ), compressed-tensors
    (its formats, block FP8, NVFP4), transformers' integrations (per-tensor FP8, MXFP4), ModelOpt's arithmetic
    (its FP8 and NVFP4) and peft for an adapter's merge; never nf4convert's own kernels or converter code.
    Exits 0 only if every weight matches, every source tensor is there and no quantization key or config
    remains. A GGUF OUTPUT is checked against llama.cpp's converter run on those references: every tensor's
    bytes and every metadata field.

    \b
    Example:
      nf4convert verify Llama-3.2-1B-Instruct-bf16 unsloth/Llama-3.2-1B-Instruct-bnb-4bit
      nf4convert verify Llama-3.2-1B-Instruct-q8_0.gguf unsloth/Llama-3.2-1B-Instruct-bnb-4bit
    """

    def action():
        from ..options import VerifyOptions
        from .run import verify_output

        options = VerifyOptions.parse(**given, progress=not quiet)
        report = verify_output(output, source, options)
        _show_report(report)
        return report.ok

    if not run_action(action):
        sys.exit(1)


@main.command("batch", cls=DeclaredCommand, declared=[("from_file", conversion_flags)])
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
@quiet_option()
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object per source (a line each) instead of the table."
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Plan every source (status 'planned') and write nothing; Hub sources as "
    "convert --dry-run reads them, without their weights.",
)
@click.option(
    "--skip-existing",
    is_flag=True,
    help="A source whose output is there already is not converted (status 'skipped', not a failure): "
    "run the same batch again to finish it.",
)
@click.option(
    "--verify",
    "then_verify",
    is_flag=True,
    help="Verify each output against its source once converted (status 'verified'), and, with "
    "--skip-existing, each output that was there already instead of skipping it.",
)
def batch_command(
    sources,
    output_root,
    from_file,
    given,
    quiet,
    as_json,
    dry_run,
    skip_existing,
    then_verify,
):
    """Convert several SOURCES into OUTPUT_ROOT; keep going when one fails, then print a table.

    Two sources with the same name get outputs named after their owners too (orgA--x-bf16, orgB--x-bf16).
    A failed source's output is the folder it was to be written to (<name>-<dtype> where its dtype was not
    decided). Exits 1 if any failed, 130 on Ctrl-C and 143 on SIGTERM (naming the sources not attempted).
    With --dry-run each source is only planned, and the bytes all of them would write are set against the free space.
    With --skip-existing an output that is there already is skipped (with --verify, verified as it is), so running
    the same batch again finishes it.

    \b
    Example:
      nf4convert batch org/a-bnb-4bit ./b-bnb-4bit -o converted/ --dtype bf16
      nf4convert batch --from-file models.txt -o converted/ --json
      nf4convert batch --from-file models.txt -o converted/ --dry-run
      nf4convert batch --from-file models.txt -o converted/ --skip-existing --verify   # resume, checking all
      nf4convert batch org/a-bnb-4bit ./b-bnb-4bit -o gguf/ --gguf-type q8_0
    """
    if skip_existing and given["overwrite"]:
        fail("--skip-existing keeps an output that is there, --overwrite replaces it: give one of them", 2)
    if dry_run and then_verify:
        fail("--dry-run writes nothing, so there is nothing to --verify", 2)
    sources = list(sources)
    if from_file is not None:
        from .run import read_source_list

        try:
            sources += read_source_list(from_file.read())
        except UnicodeDecodeError as error:
            fail(f"--from-file {from_file.name}: not UTF-8 text (byte {error.start}: {error.reason})", 2)
    if not sources:
        fail("no sources given (name them, or pass --from-file)", 2)

    def failed(row, error) -> None:
        if isinstance(error, Nf4ConvertError):
            resumed = (
                error.option == "overwrite" and not given["overwrite"]
            )  # an output there: one flag keeps, one replaces
            row.error = (
                f"{error} (pass --skip-existing to keep it, or --overwrite to replace it)"
                if resumed
                else message(error)
            )
        if not as_json:
            error_line(row.error)

    def action():
        from ..options import ConvertOptions
        from .run import batch

        options = ConvertOptions.parse(**given, progress=not quiet and not as_json)
        return batch(
            sources,
            output_root,
            options,
            dry_run=dry_run,
            skip_existing=skip_existing,
            verify=then_verify,
            on_error=failed,
            on_warning=lambda source, warning: say(f"Warning: {source}: {warning}", err=True),
        )

    result = run_action(action, stops_reported=True)
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
        if result.free is not None:
            from .run import check_room

            run_action(lambda: check_room(output_root, result.needed, result.free))
    if result.stopped is not None:
        untried = result.untried
        names = ", ".join(untried) if untried else "none"
        terminated = isinstance(result.stopped, Terminated)
        error_line(f"{'terminated' if terminated else 'interrupted'}; not attempted: {names}")
        end(128 + (result.stopped.signum if terminated else signal.SIGINT))
    if result.failed:
        say(f"{result.failed} of {len(sources)} failed", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
