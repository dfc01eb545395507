"""``convert()``: the stages in order: resolve SOURCE -> plan -> check the output -> stream -> move into place."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import preload, profile
from .adapters.config import is_adapter_folder
from .devices import pick_device
from .errors import Nf4ConvertError
from .hub.names import model_name, model_stem
from .hub.ranges import HeadersOnly
from .hub.sources import Resolved, as_text, named_sources, resolve_source
from .hub.weights import HubWeights
from .model.config import check_present as check_config_present
from .options import ConvertOptions, conversion_options, keyword_signature
from .paths import expanded
from .pipeline.routes.base import route_for
from .plan import make_plan
from .safetensors_io.read import TensorReader
from .sinks import output as lifecycle
from .sinks.base import Sink, sink_for
from .sinks.naming import output_stem
from .sizes import size_text


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
    card: str | None = None  # a one-file output (a GGUF): the model card a push uploads beside it
    made: str = ""  # what the output is, as the summary says it ("bfloat16", "GGUF q8_0 (made from bfloat16)")
    sink: str = "safetensors"  # the output format's sink (``sinks.base.SINKS``), which pushes it
    read: object = None  # a Hub SOURCE's weights (``hub.stream.StreamStats``): bytes streamed, and from the Hub cache
    # SOURCE resolved and planned (a verify that follows in this process takes them): not part of the result's value
    prepared: "Prepared | None" = field(default=None, repr=False, compare=False)
    pushed: object = None  # pushed with no local copy (``hub.push.Pushed``): ``output`` was never made


def model_card(prepared: "Prepared"):
    """The output's README.md (a ``card.Card``): the base's card made true for the dense (merged) model."""
    preload.settled()  # huggingface_hub, which the card imports, may be importing on the preload thread
    from .sinks.card import card_for_plan

    return card_for_plan(
        prepared.plan,
        base=prepared.base,
        adapter=prepared.adapter,
        revision=prepared.revision,
        title=prepared.output.name,
    )


def _card_then_importing(prepared: "Prepared", then_importing: tuple):
    """The model card, then ``then_importing`` begun on the preload thread: after the card, whose huggingface_hub
    imports must not run beside them (a GGUF's writing waits for the card)."""
    card = model_card(prepared)
    preload.start(*then_importing, here=())
    return card


def _infinite_warning(names: list[str]) -> str | None:
    """What a conversion to fp16 says of the tensors it wrote with ±inf (values beyond fp16's range, 65504, in their
    source or made so by a merge; torch's cast and bitsandbytes make them so too)."""
    if not names:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    held = f"{len(names)} tensor{'s hold' if len(names) != 1 else ' holds'}"
    return f"{held} ±inf in fp16, values beyond its range (65504): {shown}; --dtype bf16 or fp32 keeps them finite"


def _kept_warning(plan) -> str | None:
    """What a conversion that kept the NaN or ±inf values an adapter merge made (``allow_non_finite``) says of them."""
    kept = list(dict.fromkeys(line for tensor in plan.tensors for line in getattr(tensor.recipe, "non_finite", ())))
    if not kept:
        return None
    shown = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
    return f"the adapter's merge made NaN or ±inf values the base does not hold, kept as asked: {shown}"


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
    sink: Sink | None = None  # what the output is written as
    resolved: Resolved | None = None  # SOURCE and ADAPTER resolved to folders
    # a Hub SOURCE whose weights are not in the Hub cache: (their bytes, whether --download fetches them first; else a
    # conversion streams them)
    hub_weights: tuple[int, bool] | None = None

    @property
    def needed(self) -> int:
        """At most the bytes the output takes on disk."""
        return self.sink.size_bound()


def prepare(
    source: str | os.PathLike,
    options: ConvertOptions,
    *,
    reader=None,
    headers_only=False,
    on_output=None,
    weights=None,
    placed=True,
) -> Prepared:
    """Resolve and plan a conversion and check where it goes, writing nothing (what ``convert`` and a dry run do
    first). A Hub SOURCE's weights are downloaded into the Hub cache, unless ``headers_only`` (a dry run): then the
    plan reads their headers and quant states over range requests, from a copy removed before this returns (the
    plan can then be shown, not streamed; ``reader`` is not taken). ``on_output(folder)`` is told where the output
    goes as soon as that is known (a batch names it for a source that fails after that). What the output's sink
    refuses of the model (``sinks/``: llama.cpp's converter for a GGUF) is refused here, before any weight is read.
    ``weights`` (a ``hub.weights.HubWeights``, which ``reader`` reads through): a Hub SOURCE's weights are read where
    they are, streamed or from the Hub cache (else downloaded into it). ``placed`` False: the output is never put in
    place (a push with no local copy), so an OUT that exists is no reason to refuse."""
    if not headers_only:
        return _prepare(source, options, reader=reader, headers=weights, on_output=on_output, placed=placed)
    headers = HeadersOnly()
    try:
        with TensorReader(headers.ranges) as reader:
            return _prepare(source, options, reader=reader, headers=headers, on_output=on_output, placed=placed)
    except Nf4ConvertError as error:  # named by the repo, not the temporary copy
        renamed = headers.renamed(error)
        if renamed is None:
            raise
        raise renamed from None
    finally:
        headers.remove()


def _prepare(source, options: ConvertOptions, *, reader, headers=None, on_output=None, placed=True) -> Prepared:
    source, adapter = named_sources(source, options.adapter)
    sink = sink_for(options)
    options = sink.adjusted(options)
    sink.check_ready()  # before any download: a missing library is said first
    output = options.output
    if output is not None and placed:  # before any download
        local, adapter_local = (expanded(name, "source") if name is not None else None for name in (source, adapter))
        if adapter_local is None and is_adapter_folder(local):  # an adapter as SOURCE: named so
            local, adapter_local = None, local
        lifecycle.check_destination(
            output,
            overwrite=options.overwrite,
            file=sink.file,
            sources=[local] if local is not None and local.is_dir() else [],
            adapter=adapter_local if adapter_local is not None and adapter_local.is_dir() else None,
        )
    hub = options.hub
    resolved = resolve_source(source, adapter, hub, progress=options.progress, headers=headers)
    folder, adapter_folder, base, adapter, loaded_adapter = resolved
    plan = make_plan(
        folder,
        dtype=options.dtype,
        max_shard_size=options.max_shard_size,
        reader=reader,
        adapter=loaded_adapter,
        keep_non_finite=options.allow_non_finite,
    )
    check_config_present(plan.config, base, allow_missing=options.allow_no_config)
    made = sink.for_plan(options, plan, model_stem(source))
    named = output is None
    if named:
        output = made.default_output(options.output_dir, options.stem or output_stem(source))
    if on_output is not None:
        on_output(output)
    if named and placed:
        lifecycle.check_destination(
            output, overwrite=options.overwrite, file=sink.file, sources=[folder], adapter=adapter_folder
        )
    lifecycle.check_not_source(output, folder)
    if adapter_folder is not None:
        lifecycle.check_not_source(output, adapter_folder, "the adapter's")
    made.check_plan()
    free_bytes = lifecycle.free_space(output)
    return Prepared(
        plan,
        output,
        free_bytes,
        base,
        adapter,
        hub.revision if base == source else None,
        headers and headers.shown(folder),
        tuple(lifecycle.leftovers(output)),
        made,
        resolved,
        hub_weights=(headers.weight_bytes(folder), hub.download) if headers and headers.shown(folder) else None,
    )


def convert(
    source: str | os.PathLike, output: str | os.PathLike | None = None, *, on_output=None, **options
) -> ConvertResult:
    """Convert a quantized checkpoint into a dense safetensors checkpoint, or into one GGUF file.

    ``options`` are the keywords of ``options.ConvertOptions`` and those a sink declares, each as its command-line flag
    takes it (``nf4convert convert --help``): ``dtype="auto"``, ``device="auto"``, ``adapter``, ``revision``,
    ``token``, ``cache_dir``, ``download``, ``max_shard_size="5GB"``, ``overwrite``, ``progress=True``,
    ``output_dir``, ``stem``, ``allow_no_config``, ``allow_non_finite``, and the GGUF sink's ``gguf_type`` and
    ``imatrix``.

    ``output`` defaults to ``<output_dir or .>/<stem>-<dtype>``, the stem being the model's name without
    its quantization suffix (``stem`` a plain folder name; ``output`` and ``output_dir`` are not given together;
    ``~`` is expanded in ``source``, ``output`` and ``output_dir``). ``adapter`` (a folder or Hub repo id of a peft
    LoRA adapter) is merged into
    the weights it changes, bit for bit as peft's ``merge_and_unload`` on the dense model; a ``source``
    that is itself an adapter means its base with it merged. Nothing is written unless the whole output
    is: it appears under its name only once complete. ``on_output(folder)`` is told where the output goes as soon as
    that is known. A checkpoint without config.json is refused unless ``allow_no_config``: its output then holds the
    dense tensors (and the files carried over) without a config.json, which transformers needs to load a model. An
    adapter whose merge makes NaN or ±inf values that the base does not hold is refused unless ``allow_non_finite``:
    then they are written, and a warning names the tensors.

    A Hub ``source``'s weights (not in the Hub cache) are streamed into the conversion, never written to disk, unless
    ``download`` (then downloaded into the Hub cache first, as its configs and tokenizer always are); weights in the
    cache are read there. Every byte read is checked against the Hub's hash of its file before the output is placed,
    and read at the commit the run resolved at its start.

    An ``output`` ending in ``.gguf`` (or a ``gguf_type``, then named ``<stem>-<type>.gguf``) is one GGUF file, the one
    llama.cpp's converter (the "gguf" extra) writes from the dense output: of type ``gguf_type`` (f32, f16, bf16,
    q8_0), by default ``dtype``'s own float type; with ``dtype`` "auto", a float ``gguf_type`` sets the dtype too.
    One of llama-quantize's types (q4_k_m, q4_k_s, q5_k_m, q5_k_s, q6_k, q3_k_s, q3_k_m, q3_k_l, q2_k, q4_0, q4_1, q5_0,
    q5_1, iq4_nl, iq4_xs) is the file ``llama-quantize`` writes from that GGUF in ``dtype``'s own float type, with
    ``imatrix`` (a GGUF or legacy .dat file) as its ``--imatrix``.

    Raises:
        ArgumentError: a bad ``dtype``, ``device``, ``max_shard_size``, ``stem`` or ``gguf_type``, or ``output`` with
            ``output_dir``.
        DependencyError: a GGUF output without llama.cpp's converter (the "gguf" extra).
        SourceNotFoundError: ``source`` cannot be found or fetched (FetchError: its weights' bytes could not be
            fetched, after retrying).
        CheckpointError: the checkpoint is corrupt (IntegrityError: a Hub file's bytes do not match its hash), not
            a checkpoint this tool reads or has no config.json (and ``allow_no_config`` is off), or the adapter does
            not fit it.
        OutputError: the output exists (and ``overwrite`` is off), the disk is too small, or writing failed.

    Example:
        >>> convert("unsloth/Llama-3.2-1B-Instruct-bnb-4bit", "llama-1b-bf16", dtype="bf16")
    """
    options = ConvertOptions.parse(output=output, **options)
    return converted(source, options, on_output=on_output)


def converted(
    source: str | os.PathLike,
    options: ConvertOptions,
    *,
    on_output=None,
    then_importing: tuple = (),
    pushing=None,
) -> ConvertResult:
    """``convert`` with its options parsed: the stages in order. ``then_importing``: what a step after the conversion
    will import (``preload.start``'s arguments), begun on the preload thread once SOURCE is planned and the model card
    made. ``pushing`` (an opened ``hub.push.HubPush``): the output goes to the Hub as it is made (the sink's
    ``Delivery``), then is committed; its temporary files are written beside OUT, which is never made."""
    from tqdm.auto import tqdm

    from .sinks import card as _card  # noqa: F401  (imported here, not first on the side thread: see _side_thread)

    source = as_text(source)
    started = time.perf_counter()
    settings = options.settings
    profile.start("convert called", enabled=settings.profile)
    if _local_folder(source):  # a Hub SOURCE's download imports huggingface_hub's parts: not beside it
        with contextlib.suppress(Nf4ConvertError):  # said where prepare() checks it, in its order
            sink_for(options).begin_imports()
    chosen_device = pick_device(options.device)
    profile.mark("device picked")
    # The route starts now (a CUDA context takes a while) and the card is written on the side while the tensors are.
    # From the move into place on, stop signals wait for the end (they are delivered marked with the complete OUT).
    # A Hub SOURCE's weights are streamed (or read from the Hub cache), checked before the output is placed.
    finishing = contextlib.ExitStack()
    weights = HubWeights(download=options.hub.download, settings=settings)
    reader = TensorReader(weights.ranges, remote=weights.files)
    with finishing, route_for(chosen_device, settings) as route, weights, reader, _side_thread() as side:
        prepared = prepare(source, options, reader=reader, on_output=on_output, weights=weights, placed=pushing is None)
        reader.front_to_back = weights.streams
        plan, output, sink = prepared.plan, prepared.output, prepared.sink
        profile.mark("planned")
        if then_importing:
            preload.start()  # torch, on this thread (preload.start's ``here``)
        delivery = {}
        if pushing is not None:
            pushing.start(plan, prepared.base, options.hub.revision, weights, prepared.resolved.adapter_folder)
            delivery = {"delivery": pushing} if sink.delivers else {}
        needed = prepared.needed if pushing is None else sink.delivered_disk(pushing.on_disk)
        lifecycle.check_free_space(output, needed)
        card_made = side.submit(_card_then_importing, prepared, then_importing)
        with lifecycle.staging(output) as temporary:
            n_tensors = len(plan.tensors)
            with tqdm(
                total=plan.tensor_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                disable=not options.progress,
                desc=f"{model_name(source)} -> {sink.label()}",
                dynamic_ncols=True,
            ) as bar:
                progress, tensor_done = _bar_updates(bar, n_tensors, weights, pushing)
                written = sink.write(
                    temporary,
                    output,
                    reader,
                    route,
                    card=lambda: card_made.result().text,
                    settings=settings,
                    progress=progress,
                    tensor_done=tensor_done,
                    **delivery,
                )
                weights.finish()  # every byte read matched the Hub's hash of its file: the output may be placed
                card = card_made.result()
                if pushing is not None:
                    size = plan.tensor_bytes if sink.delivers else (temporary / output.name).stat().st_size
                    pushing.wait()
                    bar.set_postfix_str(f"{pushing.status()}, committing", refresh=True)
                    staged = lifecycle.staged_files(temporary, sink.pushed_card(card.text, output))
                    pushed = pushing.commit(staged, replace_weights=not sink.file)
                    bar.set_postfix_str(f"{pushing.status()}, committed", refresh=True)
            profile.mark("tensors written")
            if pushing is None:
                finishing.enter_context(lifecycle.held(output))
                size = sink.place(temporary, output, overwrite=options.overwrite)
            else:
                lifecycle.remove_staging(temporary)
        profile.mark("in place")
        profile.report()
        converter_warnings = [f"llama.cpp's converter: {line}" for line in written.warnings]
        result = ConvertResult(
            output,
            plan.dtype.name,
            written.tensors,
            plan.n_dequantized,
            size,
            time.perf_counter() - started,
            tuple(
                w
                for w in [card.warning, _infinite_warning(written.infinite), _kept_warning(plan), *converter_warnings]
                if w
            )
            + tuple(leftover.note(removed=leftover.own) for leftover in prepared.leftovers),  # the own: staging's
            plan.kinds,
            sink.own_type,
            sink.pushed_card(card.text, output),
            sink.what(),
            sink.name,
            weights.stats if weights.opened else None,
            prepared,
            pushed if pushing is not None else None,
        )
    return result


convert.__signature__ = keyword_signature(convert, conversion_options())


def _bar_updates(bar, n_tensors: int, weights: HubWeights, pushing=None):
    """The conversion bar's updates (bytes written; the tensors done beside them, the bytes fetched where the source
    is streamed, and those uploaded where the output is pushed as it is made): (progress, tensor_done) for the
    sink."""
    done = 0

    def postfix() -> None:
        fetched = f", {size_text(weights.stats.fetched)} fetched" if weights.streams else ""
        pushed = f", {pushing.status()}" if pushing is not None else ""
        bar.set_postfix_str(f"{done}/{n_tensors} tensors{fetched}{pushed}", refresh=False)

    def progress(count: int) -> None:
        if weights.streams or pushing is not None:
            postfix()
        bar.update(count)

    def tensor_done(count: int) -> None:
        nonlocal done
        done = count
        postfix()

    return progress, tensor_done


def _local_folder(source: str) -> bool:
    """Whether SOURCE names a local folder (a name that cannot be expanded is said where it is resolved)."""
    try:
        return Path(source).expanduser().is_dir()
    except (RuntimeError, OSError):
        return False


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
