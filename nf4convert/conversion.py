"""``convert()``: the stages in order: resolve SOURCE -> plan -> check the output -> stream -> move into place."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import profile
from .devices import pick_device
from .dtypes import output_dtype
from .errors import ArgumentError, CheckpointError, Nf4ConvertError
from .formats.config import check_present as check_config_present
from .hub import HeadersOnly, commit_of, looks_like_repo_id, model_name
from .paths import expanded_output
from .pipeline.routes import route_for
from .plan import make_plan
from .safetensors_io.read import TensorReader
from .settings import Settings
from .signals import held as signals_held
from .sinks import output as lifecycle
from .sinks.naming import default_output, output_stem, plain_name
from .sinks.safetensors import write_shards
from .sinks.side_files import write_side_files
from .sizes import DEFAULT_SHARD_SIZE, parse_size
from .source import as_text, named_sources, resolve_source, reworded


@dataclass(frozen=True)
class ConvertResult:
    output: Path
    dtype: str  # torch's name of the output dtype
    tensors: int
    dequantized: int  # tensors made by a recipe other than a plain copy
    bytes: int  # tensor bytes written
    seconds: float
    warnings: tuple[str, ...] = ()  # what the user should know but did not stop the run (e.g. a malformed card)
    kinds: dict[str, int] = field(default_factory=dict)  # tensors per kind, by its label (plan.Plan.kinds)


def model_card(prepared: "Prepared"):
    """The output's README.md (a ``card.Card``): the base's card made true for the dense (merged) model."""
    from . import __version__
    from .card import model_card as make_card

    plan, base = prepared.plan, prepared.base
    text = plan.card.read_bytes().decode("utf-8", errors="replace") if plan.card is not None else None
    return make_card(
        text,
        source_repo=base if looks_like_repo_id(base) and not Path(base).exists() else None,
        dtype=plan.dtype.short,
        version=__version__,
        quant_format=", ".join(plan.source_formats) or "bitsandbytes",
        adapter=prepared.adapter,
        revision=prepared.revision,
        commit=commit_of(plan.folder),
        untied=plan.untied,
        vocabulary=plan.rows,
        tokenizer=bool(plan.adapter_files),
        title=prepared.output.name,
        source_name=base,
        has_config=plan.config is not None,
    )


def _infinite_warning(names: list[str]) -> str | None:
    """What a conversion to fp16 says of the tensors it wrote with ±inf (values beyond fp16's range, 65504, in their
    source or made so by a merge; torch's cast and bitsandbytes make them so too)."""
    if not names:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"{len(names)} tensor{'s hold' if len(names) != 1 else ' holds'} ±inf in fp16, "
        "values beyond its range (65504): "
        f"{shown}; --dtype bf16 or fp32 keeps them finite"
    )


@dataclass(frozen=True)
class Prepared:
    plan: object  # plan.Plan
    output: Path
    free_bytes: int
    base: str  # the base checkpoint as the user named it (SOURCE, or the base an adapter SOURCE names)
    adapter: str | None  # the adapter as the user named it
    revision: str | None = None  # the base's revision as the user gave it (None: the default branch)
    headers_only: str | None = None  # planned from its headers alone: the Hub repo as "repo@commit" (its copy is gone)
    leftovers: tuple = ()  # sinks.output.Leftover: killed runs' staging folders beside the output


def prepare(
    source: str | os.PathLike,
    output=None,
    *,
    dtype="auto",
    adapter=None,
    revision=None,
    token=None,
    cache_dir=None,
    max_shard_size=DEFAULT_SHARD_SIZE,
    overwrite=False,
    output_dir=None,
    stem=None,
    reader=None,
    progress=True,
    headers_only=False,
    on_output=None,
    allow_no_config=False,
) -> Prepared:
    """Resolve and plan a conversion and check where it goes, writing nothing (what ``convert`` and a dry run do
    first). A Hub SOURCE's weights are downloaded into the Hub cache, unless ``headers_only`` (a dry run): then the
    plan reads their headers and quant states over range requests, from a copy removed before this returns (the
    plan can then be shown, not streamed; ``reader`` is not taken). ``on_output(folder)`` is told where the output
    goes as soon as that is known (a batch names it for a source that fails after that). A checkpoint without
    config.json is refused unless ``allow_no_config``."""
    options = dict(
        dtype=dtype,
        adapter=adapter,
        revision=revision,
        token=token,
        cache_dir=cache_dir,
        max_shard_size=max_shard_size,
        overwrite=overwrite,
        output_dir=output_dir,
        stem=stem,
        progress=progress,
        on_output=on_output,
        allow_no_config=allow_no_config,
    )
    if not headers_only:
        return _prepare(source, output, reader=reader, **options)
    headers = HeadersOnly()
    try:
        with TensorReader(headers.ranges) as reader:
            return _prepare(source, output, reader=reader, headers=headers, **options)
    except Nf4ConvertError as error:  # named by the repo, not the temporary copy
        text = str(error)
        for copy in [folder for folder, _ in headers.copies.values()]:
            text = text.replace(str(copy), headers.shown(copy))
        if text == str(error):
            raise
        renamed = type(error)(text, option=error.option)
        renamed.__dict__.update(error.__dict__)
        raise renamed from None
    finally:
        headers.remove()


def _prepare(
    source,
    output,
    *,
    dtype,
    adapter,
    revision,
    token,
    cache_dir,
    max_shard_size,
    overwrite,
    output_dir,
    stem,
    reader,
    progress,
    headers=None,
    on_output=None,
    allow_no_config=False,
) -> Prepared:
    Settings.from_env()  # a dry run refuses a bad NF4CONVERT_* value as the conversion does
    source, adapter = named_sources(source, adapter)
    if output is not None and (output_dir is not None or stem is not None):
        given = "output_dir" if output_dir is not None else "stem"
        raise ArgumentError(
            f"output and {given} both given: output names the folder itself, output_dir and stem name "
            "it for you; give one or the other",
            option=given,
        )
    if stem is not None and not plain_name(stem):
        raise ArgumentError(f"stem {stem!r} is not a plain folder name (no '/', not '.' or '..')", option="stem")
    shard_limit = parse_size(max_shard_size)
    output_dtype(dtype)
    if output is not None:  # before any download
        output = expanded_output(output, "output")
        lifecycle.check_destination(output, overwrite=overwrite)
    folder, adapter_folder, base, adapter = resolve_source(
        source, adapter, revision=revision, token=token, cache_dir=cache_dir, progress=progress, headers=headers
    )
    try:
        plan = make_plan(folder, dtype=dtype, max_shard_size=shard_limit, reader=reader, adapter=adapter_folder)
    except CheckpointError as error:
        better = reworded(error, folder)
        if better is error:
            raise
        raise better from None
    check_config_present(plan.config, base, allow_missing=allow_no_config)
    named = output is None
    if named:
        output = default_output(output_dir, stem or output_stem(source), plan.dtype.short)
    if on_output is not None:
        on_output(output)
    if named:
        lifecycle.check_destination(output, overwrite=overwrite)
    lifecycle.check_not_source(output, folder)
    if adapter_folder is not None:
        lifecycle.check_not_source(output, adapter_folder)
    free_bytes = lifecycle.free_space(output)
    return Prepared(
        plan,
        output,
        free_bytes,
        base,
        adapter,
        revision if base == source else None,
        headers and headers.shown(folder),
        tuple(lifecycle.leftovers(output)),
    )


def convert(
    source: str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    adapter: str | os.PathLike | None = None,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | None = None,
    max_shard_size: str | int = DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    progress: bool = True,
    output_dir: str | os.PathLike | None = None,
    stem: str | None = None,
    on_output=None,
    allow_no_config: bool = False,
) -> ConvertResult:
    """Convert a bitsandbytes checkpoint (4-bit NF4/FP4 or 8-bit LLM.int8) into a dense safetensors checkpoint.

    ``output`` defaults to ``<output_dir or .>/<stem>-<dtype>``, the stem being the model's name without
    its quantization suffix (``stem`` a plain folder name; ``output`` and ``output_dir`` are not given together;
    ``~`` is expanded in ``source``, ``output`` and ``output_dir``). ``adapter`` (a folder or Hub repo id of a peft
    LoRA adapter) is merged into
    the weights it changes, bit for bit as peft's ``merge_and_unload`` on the dense model; a ``source``
    that is itself an adapter means its base with it merged. Nothing is written unless the whole output
    is: it appears under its name only once complete. ``on_output(folder)`` is told where the output goes as soon as
    that is known. A checkpoint without config.json is refused unless ``allow_no_config``: its output then holds the
    dense tensors (and the files carried over) without a config.json, which transformers needs to load a model.

    Raises:
        ArgumentError: a bad ``dtype``, ``device``, ``max_shard_size`` or ``stem``, or ``output`` with ``output_dir``.
        SourceNotFoundError: ``source`` cannot be found or fetched.
        CheckpointError: the checkpoint is corrupt, not a bitsandbytes checkpoint or has no config.json (and
            ``allow_no_config`` is off), or the adapter does not fit it.
        OutputError: the output exists (and ``overwrite`` is off), the disk is too small, or writing failed.

    Example:
        >>> convert("unsloth/Llama-3.2-1B-Instruct-bnb-4bit", "llama-1b-bf16", dtype="bf16")
    """
    from tqdm.auto import tqdm

    from . import card as _card  # noqa: F401  (imported here, not first on the side thread: see _side_thread)

    source = as_text(source)
    started = time.perf_counter()
    settings = Settings.from_env()
    profile.start("convert called", enabled=settings.profile)
    chosen_device = pick_device(device)
    profile.mark("device picked")
    # The route starts now (a CUDA context takes a while) and the card is written on the side while the tensors are.
    # From the move into place on, stop signals wait for the end (they are delivered marked with the complete OUT).
    finishing = contextlib.ExitStack()
    with finishing, route_for(chosen_device, settings) as route, TensorReader() as reader, _side_thread() as side:
        prepared = prepare(
            source,
            output,
            dtype=dtype,
            adapter=adapter,
            revision=revision,
            token=token,
            cache_dir=cache_dir,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            output_dir=output_dir,
            stem=stem,
            reader=reader,
            progress=progress,
            on_output=on_output,
            allow_no_config=allow_no_config,
        )
        plan, output = prepared.plan, prepared.output
        profile.mark("planned")
        lifecycle.check_free_space(output, plan.tensor_bytes + plan.side_bytes)
        card = side.submit(model_card, prepared)
        with lifecycle.staging(output) as temporary:
            n_tensors = len(plan.tensors)
            with tqdm(
                total=plan.tensor_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                disable=not progress,
                desc=f"{model_name(source)} -> {plan.dtype.name}",
                dynamic_ncols=True,
            ) as bar:
                infinite = write_shards(
                    plan,
                    temporary,
                    reader,
                    chosen_device,
                    progress=bar.update,
                    route=route,
                    settings=settings,
                    tensor_done=lambda done: bar.set_postfix_str(f"{done}/{n_tensors} tensors", refresh=False),
                )
            profile.mark("tensors written")
            card = card.result()
            write_side_files(plan, temporary, card.text)
            finishing.enter_context(signals_held(output))
            lifecycle.move_into_place(temporary, output, overwrite=overwrite)
        profile.mark("in place")
        profile.report()
        result = ConvertResult(
            output,
            plan.dtype.name,
            len(plan.tensors),
            plan.n_dequantized,
            plan.tensor_bytes,
            time.perf_counter() - started,
            tuple(w for w in [card.warning, _infinite_warning(infinite)] if w)
            + tuple(leftover.note(removed=leftover.own) for leftover in prepared.leftovers),  # the own: staging's
            plan.kinds,
        )
    return result


@contextlib.contextmanager
def _side_thread():
    """One worker thread (the model card), not waited for when the run fails: a worker that cannot finish must not
    hold up the failure's report and exit. The modules it needs are imported by the caller first: an import on
    both threads at once, with the main thread's interrupted inside it (Ctrl-C), left one waiting forever."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1, thread_name_prefix="nf4convert-side")
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
