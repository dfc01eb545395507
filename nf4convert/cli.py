"""The command line: parsing and messages only; the work is in conversion.py and verification.py.

torch, Triton and bitsandbytes are imported inside the commands, so ``--help`` is instant.
"""

from __future__ import annotations

import sys

import click

from . import __version__
from .dtypes import OUTPUT_CHOICES

# What a library error's ``option`` becomes on the command line.
HINTS = {
    "overwrite": "pass --overwrite to replace it",
    "token": "pass --token or set HF_TOKEN",
    "revision": "see --revision",
    "dtype": "see --dtype",
    "device": "see --device",
    "max_shard_size": "see --max-shard-size",
}


class DefaultGroup(click.Group):
    """``nf4convert SOURCE ...`` means ``nf4convert convert SOURCE ...``; usage errors are one line."""

    def main(self, *args, **kwargs):
        kwargs.pop("standalone_mode", None)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.ClickException as error:  # a bad option or argument: one line, not the usage text
            click.echo(f"Error: {error.format_message()} (see 'nf4convert --help')", err=True)
            sys.exit(error.exit_code)
        except click.exceptions.Abort:
            click.echo("Error: aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["convert", *args]
        return super().parse_args(ctx, args)


def _fail(message: str, code: int = 1):
    click.echo(f"Error: {message}", err=True)
    sys.exit(code)


def _run(action):
    """Run ``action``; user mistakes and bad input become one line and a non-zero exit."""
    from .errors import Nf4ConvertError

    try:
        return action()
    except KeyboardInterrupt:
        _fail("interrupted; nothing was written", 130)
    except Nf4ConvertError as error:
        _fail(message(error))


def message(error) -> str:
    """A library error's line, with the flag that would change the outcome."""
    hint = HINTS.get(getattr(error, "option", None) or "")
    return f"{error} ({hint})" if hint else str(error)


@click.group(cls=DefaultGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="nf4convert")
def main():
    """Turn bitsandbytes 4-bit (NF4/FP4) checkpoints into dense safetensors checkpoints.

    \b
    Examples:
      nf4convert unsloth/Llama-3.2-1B-Instruct-bnb-4bit            # -> ./Llama-3.2-1B-Instruct-bf16
      nf4convert ./my-model-bnb-4bit -o my-model-fp16 --dtype fp16
      nf4convert verify my-model-fp16 ./my-model-bnb-4bit
      nf4convert batch org/a-bnb-4bit org/b-bnb-4bit -o converted/
    """


def _common_source_options(function):
    for option in reversed([
        click.option("--revision", help="Hub branch, tag or commit (default: main)."),
        click.option("--token", envvar="HF_TOKEN", help="Hub token for private or gated repos (default: $HF_TOKEN)."),
        click.option("--cache-dir", type=click.Path(file_okay=False), help="Hub cache folder (default: $HF_HUB_CACHE)."),
    ]):  # fmt: skip
        function = option(function)
    return function


def _convert_options(function):
    for option in reversed([
        click.option("--dtype", type=click.Choice(OUTPUT_CHOICES), default="auto", show_default=True,
                     help="Output dtype; auto keeps the dtype the model was quantized from."),
        click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N (auto: the GPU if there is one)."),
        click.option("--max-shard-size", default="5GB", show_default=True, help="Largest output shard, like transformers'."),
        click.option("--overwrite", is_flag=True, help="Replace OUT if it exists (only once the new output is complete)."),
        click.option("-q", "--quiet", is_flag=True, help="No progress bar."),
    ]):  # fmt: skip
        function = option(function)
    return _common_source_options(function)


@main.command("convert")
@click.argument("source")
@click.option("-o", "--output", type=click.Path(), help="Output folder (default: ./<name>-<dtype>).")
@_convert_options
def convert_command(source, output, dtype, device, max_shard_size, overwrite, quiet, revision, token, cache_dir):
    """Convert SOURCE (a Hub repo id, a local folder, or a repo in the Hub cache).

    \b
    Memory stays at a few tensors' worth, whatever the model size; the output is written to a
    temporary folder beside OUT and renamed into place only when complete.
    \b
    Examples:
      nf4convert convert unsloth/Qwen2.5-0.5B-Instruct-bnb-4bit --dtype bf16
      nf4convert convert ./local-bnb-4bit -o dense --max-shard-size 2GB --device cpu
    """

    def action():
        from .conversion import convert

        result = convert(source, output, dtype=dtype, device=device, revision=revision, token=token, cache_dir=cache_dir,
                         max_shard_size=max_shard_size, overwrite=overwrite, progress=not quiet)  # fmt: skip
        if not quiet:
            click.echo(f"{result.output}: {result.tensors} tensors ({result.dequantized} dequantized), "
                       f"{result.bytes / 1e9:.2f} GB {result.dtype}, {result.seconds:.1f} s")  # fmt: skip

    _run(action)


@main.command("verify")
@click.argument("output", type=click.Path())
@click.argument("source")
@click.option("--device", default="auto", show_default=True, help="Where bitsandbytes dequantizes: auto, cpu, cuda, cuda:N.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@_common_source_options
def verify_command(output, source, device, quiet, revision, token, cache_dir):
    """Check OUTPUT against SOURCE with bitsandbytes' own dequantize_4bit, bit for bit.

    Exits 0 only if every weight matches, every source tensor is there and no quantization
    key or config remains.

    \b
    Example:
      nf4convert verify Llama-3.2-1B-Instruct-bf16 unsloth/Llama-3.2-1B-Instruct-bnb-4bit
    """

    def action():
        from .verification import report_lines, verify

        report = verify(output, source, device=device, revision=revision, token=token, cache_dir=cache_dir, progress=not quiet)
        for line in report_lines(report):
            click.echo(line)
        return report.ok

    if not _run(action):
        sys.exit(1)


@main.command("batch")
@click.argument("sources", nargs=-1)
@click.option("-o", "--output-root", "output_root", type=click.Path(file_okay=False), required=True,
              help="Folder that receives one <name>-<dtype> folder per source.")  # fmt: skip
@click.option("--from-file", type=click.File("r"), help="Read more sources from this file, one per line (# comments).")
@_convert_options
def batch_command(sources, output_root, from_file, dtype, device, max_shard_size, overwrite, quiet, revision, token, cache_dir):
    """Convert several SOURCES into OUTPUT_ROOT; keep going when one fails, then print a table.

    \b
    Example:
      nf4convert batch org/a-bnb-4bit ./b-bnb-4bit -o converted/ --dtype bf16
      nf4convert batch --from-file models.txt -o converted/
    """
    import time

    from .conversion import convert
    from .errors import Nf4ConvertError

    sources = list(sources)
    if from_file is not None:
        sources += [line.split("#")[0].strip() for line in from_file if line.split("#")[0].strip()]
    if not sources:
        _fail("no sources given (name them, or pass --from-file)")
    rows = []
    for source in sources:
        started = time.perf_counter()
        try:
            result = convert(source, dtype=dtype, device=device, revision=revision, token=token, cache_dir=cache_dir,
                             max_shard_size=max_shard_size, overwrite=overwrite, progress=not quiet, output_dir=output_root)  # fmt: skip
            rows.append((source, "ok", str(result.tensors), f"{result.bytes / 1e9:.2f} GB", f"{result.seconds:.1f}"))
        except KeyboardInterrupt:
            rows.append((source, "interrupted", "-", "-", f"{time.perf_counter() - started:.1f}"))
            break
        except Nf4ConvertError as error:
            click.echo(f"Error: {message(error)}", err=True)
            rows.append((source, "failed", "-", "-", f"{time.perf_counter() - started:.1f}"))
    header = ("source", "status", "tensors", "bytes", "seconds")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(5)]
    for row in [header, *rows]:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)))
    failed = sum(1 for row in rows if row[1] != "ok") + (len(sources) - len(rows))
    if failed:
        click.echo(f"{failed} of {len(sources)} failed", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
