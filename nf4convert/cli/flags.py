"""The options the commands share, declared once: where sources come from (``--revision``, ``--token``,
``--cache-dir``, ``--download``) and how a conversion is made (``--adapter``, ``--dtype``, ``--gguf-type``,
``--device``, ...)."""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass

import click

from ..dtypes import OUTPUT_CHOICES
from ..options import ConvertOptions
from ..sinks.gguf.converter import ALL_TYPES
from ..sizes import DEFAULT_SHARD_SIZE


def quiet(ctx, param, value) -> bool:
    return value or sys.stderr is None  # no standard error (closed at start): no bars to draw on it


def source_options(function):
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
            click.option(
                "--download",
                is_flag=True,
                help="Download a Hub SOURCE's weights into the Hub cache first and read them there. By default they "
                "are streamed as they are read: no copy on disk, the download overlapped with the work. Pick "
                "--download to read the same repo again later (or offline); weights already in the cache are read "
                "there either way, and every byte is checked against the Hub's hash in both.",
            ),
        ]
    ):
        function = option(function)
    return function


ADAPTER_HELP = "A peft LoRA adapter (folder or Hub repo id) to merge into the weights, bit for bit as peft merges."


def one_adapter(ctx, param, values):
    """--adapter given once at most: click would keep the last of several and drop the others unsaid."""
    if len(values) > 1:
        raise click.BadParameter(
            f"given {len(values)} times; one adapter per conversion (merge several into one with peft first)"
        )
    return values[0] if values else None


@dataclass(frozen=True)
class ConvertFlags:
    """The options every conversion takes, as the command line gave them: gathered by ``convert_options`` into one
    argument of the command, parsed where it runs (a bad value is then one line, as any error of a run)."""

    adapter: str | None
    dtype: str
    gguf_type: str | None
    imatrix: str | None
    device: str
    max_shard_size: str
    overwrite: bool
    allow_no_config: bool
    allow_non_finite: bool
    revision: str | None
    token: str | None
    cache_dir: str | None
    download: bool

    def parse(self, *, output=None, progress: bool) -> ConvertOptions:
        return ConvertOptions.parse(
            output=output,
            dtype=self.dtype,
            adapter=self.adapter,
            revision=self.revision,
            token=self.token,
            cache_dir=self.cache_dir,
            download=self.download,
            device=self.device,
            max_shard_size=self.max_shard_size,
            overwrite=self.overwrite,
            allow_no_config=self.allow_no_config,
            allow_non_finite=self.allow_non_finite,
            gguf_type=self.gguf_type,
            imatrix=self.imatrix,
            progress=progress,
        )


def convert_options(command):
    """Declare the options every conversion takes; the command receives them as one ``flags`` (``ConvertFlags``)."""

    @functools.wraps(command)
    def gathered(*args, **params):
        flags = ConvertFlags(**{field.name: params.pop(field.name) for field in dataclasses.fields(ConvertFlags)})
        return command(*args, flags=flags, **params)

    function = gathered
    for option in reversed(
        [
            click.option("--adapter", multiple=True, callback=one_adapter, help=ADAPTER_HELP),
            click.option(
                "--dtype",
                type=click.Choice(OUTPUT_CHOICES, case_sensitive=False),
                default="auto",
                show_default=True,
                help="Output dtype; auto keeps the dtype the model was quantized from.",
            ),
            click.option(
                "--gguf-type",
                type=click.Choice(ALL_TYPES, case_sensitive=False),
                help="Write one GGUF file of this type, as llama.cpp's converter writes it from the dense output "
                "(default with a .gguf OUT: the --dtype's own float type); q4_k_m and llama-quantize's other types: "
                "the file llama-quantize makes of that one, byte for byte.",
            ),
            click.option(
                "--imatrix",
                type=click.Path(dir_okay=False),
                help="Importance matrix for a llama-quantize type (GGUF or legacy .dat), as llama-quantize takes it.",
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
                "--allow-no-config",
                is_flag=True,
                help="Convert a SOURCE that has no config.json (refused otherwise): the output holds the dense tensors "
                "without one, so transformers cannot load it as a model by itself.",
            ),
            click.option(
                "--allow-non-finite",
                is_flag=True,
                help="Keep the NaN or ±inf values an adapter's merge makes where the base has none (refused otherwise: "
                "such a model is broken); a warning names the tensors.",
            ),
            click.option(
                "-q",
                "--quiet",
                is_flag=True,
                callback=quiet,
                help="No progress bars (downloads and uploads too); the one-line summary stays.",
            ),
        ]
    ):
        function = option(function)
    return source_options(function)
