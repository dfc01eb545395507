"""``convert()``: the stages in order: resolve SOURCE -> plan -> check the output -> stream -> move into place."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from .hub import model_name

DEFAULT_SHARD_SIZE = "5GB"


@dataclass(frozen=True)
class ConvertResult:
    output: Path
    dtype: str  # torch's name of the output dtype
    tensors: int
    dequantized: int
    bytes: int  # tensor bytes written
    seconds: float


def default_output(source: str, dtype) -> Path:
    """``<name>-<dtype>`` for a SOURCE, a quantization suffix dropped: org/Llama-bnb-4bit -> Llama-bf16."""
    name = model_name(source)
    for suffix in ("-bnb-4bit", "-bnb-nf4", "-bnb-fp4", "-bnb-8bit", "-4bit", "-nf4", "-fp4", "-8bit", "-int8"):
        if name.lower().endswith(suffix):
            name = name[: -len(suffix)]
            break
    return Path(f"{name}-{dtype.short}")


def convert(
    source: str,
    output: str | os.PathLike | None = None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | None = None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    progress: bool = True,
    output_dir: str | os.PathLike | None = None,
) -> ConvertResult:
    """Convert a bitsandbytes checkpoint (4-bit NF4/FP4 or 8-bit LLM.int8) into a dense safetensors checkpoint.

    ``output`` defaults to ``<output_dir or .>/<name>-<dtype>``. Nothing is written unless the whole
    output is: it appears under its name only once complete.

    Raises:
        ArgumentError: a bad ``dtype``, ``device`` or ``max_shard_size``.
        SourceNotFoundError: ``source`` cannot be found or fetched.
        CheckpointError: the checkpoint is corrupt or not a bitsandbytes checkpoint.
        OutputError: the output exists (and ``overwrite`` is off), the disk is too small, or writing failed.

    Example:
        >>> convert("unsloth/Llama-3.2-1B-Instruct-bnb-4bit", "llama-1b-bf16", dtype="bf16")
    """
    from tqdm.auto import tqdm

    from . import output as lifecycle
    from .checkpoint import TensorReader
    from .devices import pick_device
    from .dtypes import output_dtype
    from .hub import resolve
    from .plan import make_plan, parse_size
    from .stream import write_shards

    started = time.perf_counter()
    shard_limit = parse_size(max_shard_size)
    output_dtype(dtype)
    chosen_device = pick_device(device)
    if output is not None:  # before any download
        lifecycle.check_destination(Path(output), overwrite=overwrite)
    folder = resolve(source, revision=revision, token=token, cache_dir=cache_dir)
    with TensorReader() as reader:
        plan = make_plan(folder, dtype=dtype, max_shard_size=shard_limit, reader=reader)
        if output is None:
            output = Path(output_dir or ".") / default_output(source, plan.dtype)
            lifecycle.check_destination(output, overwrite=overwrite)
        output = Path(output)
        lifecycle.check_not_source(output, folder)
        lifecycle.check_free_space(output, plan.tensor_bytes + plan.side_bytes)
        with lifecycle.staging(output) as temporary:
            n_tensors = len(plan.tensors)
            with tqdm(total=plan.tensor_bytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
                      desc=f"{model_name(source)} -> {plan.dtype.name}", dynamic_ncols=True) as bar:  # fmt: skip
                write_shards(plan, temporary, reader, chosen_device, progress=bar.update,
                             tensor_done=lambda done: bar.set_postfix_str(f"{done}/{n_tensors} tensors", refresh=False))  # fmt: skip
            lifecycle.write_side_files(plan, temporary)
            lifecycle.move_into_place(temporary, output)
    return ConvertResult(output, plan.dtype.name, len(plan.tensors), plan.n_dequantized, plan.tensor_bytes,
                         time.perf_counter() - started)  # fmt: skip
