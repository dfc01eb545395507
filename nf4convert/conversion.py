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
from .hub.names import model_name, model_stem
from .hub.ranges import HeadersOnly
from .hub.sources import as_text, named_sources, resolve_source, reworded
from .paths import expanded_output
from .pipeline.routes.base import route_for
from .plan import make_plan
from .safetensors_io.read import TensorReader
from .settings import Settings
from .sinks import output as lifecycle
from .sinks.gguf import sink as gguf_sink
from .sinks.gguf.converter import dense_dtype
from .sinks.naming import default_output, output_stem, plain_name
from .sinks.safetensors import write_shards
from .sinks.side_files import write_side_files
from .sizes import DEFAULT_SHARD_SIZE, parse_size


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
    gguf_type: str | None = None  # a GGUF output: its type (``dtype`` is then that of the tensors it was made from)
    card: str | None = None  # a GGUF output: the model card a push uploads beside it


def model_card(prepared: "Prepared"):
    """The output's README.md (a ``card.Card``): the base's card made true for the dense (merged) model."""
    from .hub.card import card_for_plan

    return card_for_plan(
        prepared.plan,
        base=prepared.base,
        adapter=prepared.adapter,
        revision=prepared.revision,
        title=prepared.output.name,
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
    gguf: gguf_sink.GgufTarget | None = None  # a GGUF output (else a folder)


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
    gguf_type=None,
) -> Prepared:
    """Resolve and plan a conversion and check where it goes, writing nothing (what ``convert`` and a dry run do
    first). A Hub SOURCE's weights are downloaded into the Hub cache, unless ``headers_only`` (a dry run): then the
    plan reads their headers and quant states over range requests, from a copy removed before this returns (the
    plan can then be shown, not streamed; ``reader`` is not taken). ``on_output(folder)`` is told where the output
    goes as soon as that is known (a batch names it for a source that fails after that). A checkpoint without
    config.json is refused unless ``allow_no_config``. An ``output`` ending in ``.gguf``, or a ``gguf_type``, means one
    GGUF file (``sinks/gguf.py``): what llama.cpp's converter refuses of the model is refused here too, before any
    weight is read."""
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
        gguf_type=gguf_type,
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
    gguf_type=None,
) -> Prepared:
    Settings.from_env()  # a dry run refuses a bad NF4CONVERT_* value as the conversion does
    source, adapter = named_sources(source, adapter)
    gguf = gguf_sink.is_gguf(output) or (output is None and gguf_type is not None)
    if gguf_type is not None and not gguf:
        raise ArgumentError(
            f"gguf_type {gguf_type!r} writes one GGUF file: give an output ending in .gguf", option="gguf_type"
        )
    if gguf:
        dtype = dense_dtype(dtype, gguf_type)
        max_shard_size = DEFAULT_SHARD_SIZE  # the converter's tensor order is that of the default dense output
        gguf_sink.converter()  # before any download: without the "gguf" extra, say what to install
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
        lifecycle.check_destination(output, overwrite=overwrite, file=gguf)
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
    target = None
    if gguf:
        target = gguf_sink.GgufTarget(gguf_sink.written_type(gguf_type, plan.dtype), model_stem(source))
    if named and gguf:
        output = gguf_sink.default_gguf_output(output_dir, stem or output_stem(source), target.type)
    elif named:
        output = default_output(output_dir, stem or output_stem(source), plan.dtype.short)
    if on_output is not None:
        on_output(output)
    if named:
        lifecycle.check_destination(output, overwrite=overwrite, file=gguf)
    lifecycle.check_not_source(output, folder)
    if adapter_folder is not None:
        lifecycle.check_not_source(output, adapter_folder)
    if target is not None:
        gguf_sink.check_convertible(plan, target.type, target.name)
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
        target,
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
    gguf_type: str | None = None,
) -> ConvertResult:
    """Convert a bitsandbytes checkpoint (4-bit NF4/FP4 or 8-bit LLM.int8) into a dense safetensors checkpoint, or into
    one GGUF file.

    ``output`` defaults to ``<output_dir or .>/<stem>-<dtype>``, the stem being the model's name without
    its quantization suffix (``stem`` a plain folder name; ``output`` and ``output_dir`` are not given together;
    ``~`` is expanded in ``source``, ``output`` and ``output_dir``). ``adapter`` (a folder or Hub repo id of a peft
    LoRA adapter) is merged into
    the weights it changes, bit for bit as peft's ``merge_and_unload`` on the dense model; a ``source``
    that is itself an adapter means its base with it merged. Nothing is written unless the whole output
    is: it appears under its name only once complete. ``on_output(folder)`` is told where the output goes as soon as
    that is known. A checkpoint without config.json is refused unless ``allow_no_config``: its output then holds the
    dense tensors (and the files carried over) without a config.json, which transformers needs to load a model.

    An ``output`` ending in ``.gguf`` (or a ``gguf_type``, then named ``<stem>-<type>.gguf``) is one GGUF file, the one
    llama.cpp's converter (the "gguf" extra) writes from the dense output: of type ``gguf_type`` (f32, f16, bf16,
    q8_0), by default ``dtype``'s own float type; with ``dtype`` "auto", a float ``gguf_type`` sets the dtype too.

    Raises:
        ArgumentError: a bad ``dtype``, ``device``, ``max_shard_size``, ``stem`` or ``gguf_type``, or ``output`` with
            ``output_dir``.
        DependencyError: a GGUF output without llama.cpp's converter (``pip install "nf4convert[gguf]"``).
        SourceNotFoundError: ``source`` cannot be found or fetched.
        CheckpointError: the checkpoint is corrupt, not a bitsandbytes checkpoint or has no config.json (and
            ``allow_no_config`` is off), or the adapter does not fit it.
        OutputError: the output exists (and ``overwrite`` is off), the disk is too small, or writing failed.

    Example:
        >>> convert("unsloth/Llama-3.2-1B-Instruct-bnb-4bit", "llama-1b-bf16", dtype="bf16")
    """
    from tqdm.auto import tqdm

    from .hub import card as _card  # noqa: F401  (imported here, not first on the side thread: see _side_thread)

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
            gguf_type=gguf_type,
        )
        plan, output, gguf = prepared.plan, prepared.output, prepared.gguf
        profile.mark("planned")
        needed = gguf_sink.size_bound(plan, gguf.type) if gguf else plan.tensor_bytes + plan.side_bytes
        lifecycle.check_free_space(output, needed)
        card = side.submit(model_card, prepared)
        written = None
        with lifecycle.staging(output) as temporary:
            n_tensors = len(plan.tensors)
            with tqdm(
                total=plan.tensor_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                disable=not progress,
                desc=f"{model_name(source)} -> {f'GGUF {gguf.type}' if gguf else plan.dtype.name}",
                dynamic_ncols=True,
            ) as bar:
                if gguf:
                    written = gguf_sink.write_gguf(
                        plan,
                        temporary / output.name,
                        reader,
                        route,
                        gguf_type=gguf.type,
                        name=gguf.name,
                        card=card.result().text,
                        settings=settings,
                        progress=bar.update,
                    )
                    infinite = written.infinite
                else:
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
            if not gguf:
                write_side_files(plan, temporary, card.text)
            finishing.enter_context(lifecycle.held(output))
            if gguf:
                size = (temporary / output.name).stat().st_size
                lifecycle.move_file_into_place(temporary, output, overwrite=overwrite)
            else:
                lifecycle.move_into_place(temporary, output, overwrite=overwrite)
        profile.mark("in place")
        profile.report()
        converter_warnings = [f"llama.cpp's converter: {line}" for line in (written.warnings if written else [])]
        result = ConvertResult(
            output,
            plan.dtype.name,
            written.tensors if written else len(plan.tensors),
            plan.n_dequantized,
            size if gguf else plan.tensor_bytes,
            time.perf_counter() - started,
            tuple(w for w in [card.warning, _infinite_warning(infinite), *converter_warnings] if w)
            + tuple(leftover.note(removed=leftover.own) for leftover in prepared.leftovers),  # the own: staging's
            plan.kinds,
            gguf.type if gguf else None,
            gguf_sink.pushed_card(card.text, output.name, gguf.type) if gguf else None,
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
