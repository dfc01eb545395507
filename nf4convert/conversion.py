"""``convert()``: the stages in order: resolve SOURCE -> plan -> check the output -> stream -> move into place."""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from . import knobs
from .errors import ArgumentError, CheckpointError
from .hub import commit_of, looks_like_repo_id, model_name
from .paths import expanded, expanded_output
from .plan import DEFAULT_SHARD_SIZE

QUANT_SUFFIX = re.compile(r"-(?:bnb-)?(?:4bit|nf4|fp4|8bit|int8)$", re.IGNORECASE)


@dataclass(frozen=True)
class ConvertResult:
    output: Path
    dtype: str  # torch's name of the output dtype
    tensors: int
    dequantized: int  # tensors made by a recipe other than a plain copy
    bytes: int  # tensor bytes written
    seconds: float
    warnings: tuple[str, ...] = ()  # what the user should know but did not stop the run (e.g. a malformed card)


def model_card(prepared: "Prepared"):
    """The output's README.md (a ``card.Card``): the base's card made true for the dense (merged) model."""
    from . import __version__
    from .card import model_card as make_card

    plan, base = prepared.plan, prepared.base
    text = plan.card.read_bytes().decode("utf-8", errors="replace") if plan.card is not None else None
    return make_card(text, source_repo=base if looks_like_repo_id(base) and not Path(base).exists() else None,
                     dtype=plan.dtype.short, version=__version__, quant_format=", ".join(plan.source_formats) or "bitsandbytes",
                     adapter=prepared.adapter, revision=prepared.revision, commit=commit_of(plan.folder))  # fmt: skip


def output_stem(source: str, *, qualified: bool = False) -> str:
    """The default output's name before ``-<dtype>``: the model's name, a quantization suffix dropped
    (org/Llama-bnb-4bit -> Llama); ``qualified`` puts the owner (or parent folder) first: org--Llama."""
    name = QUANT_SUFFIX.sub("", model_name(source)) or model_name(source)
    if qualified:
        parent = source.rstrip("/").split("/")[-2] if looks_like_repo_id(source) else expanded(source, "source").resolve().parent.name
        name = f"{parent}--{name}" if parent else name
    return name


def batch_stems(sources: list[str]) -> list[str]:
    """Distinct output stems for a batch: a name that two sources share (case-insensitively, as some file
    systems compare) is qualified with each one's owner; the same source twice is an ArgumentError (a local
    folder, as ``hub.resolve`` takes it first, is the same source under any spelling of its path)."""
    seen = {}
    for source in sources:
        local = expanded(source, "source")
        key = str(local.resolve()) if local.is_dir() or not looks_like_repo_id(source) else source.rstrip("/")
        if key in seen:
            raise ArgumentError(f"{source}: given twice (as {seen[key]!r} too)")
        seen[key] = source
    plain = [output_stem(source).lower() for source in sources]
    stems = [output_stem(source, qualified=plain.count(stem) > 1) for source, stem in zip(sources, plain)]
    lowered = [stem.lower() for stem in stems]
    for source, stem in zip(sources, lowered):
        if lowered.count(stem) > 1:
            others = [other for other, s in zip(sources, lowered) if s == stem and other != source]
            raise ArgumentError(f"{source} and {others[0]} would both be written to '{stem}-<dtype>'; convert them apart with -o")
    return stems


def check_batch_root(output_root, folders) -> None:
    """ArgumentError if a batch's output root is one of the local ``folders`` (its SOURCEs, its ADAPTER) or inside one:
    every output would be written into a source. A root that holds them is fine: the outputs go beside them."""
    from .output import placed

    root = expanded_output(output_root, "output")
    for name in folders:
        folder = expanded(name, "source") if name is not None else None
        if folder is None or not folder.is_dir():
            continue  # a Hub repo id (or a missing folder, which its conversion reports)
        where = placed(root, folder)
        if where in ("is", "inside"):
            raise ArgumentError(f"-o {output_root}: is {'' if where == 'is' else 'inside '}the source folder {name}; "
                                "outputs are never written into a source (choose another output root)")  # fmt: skip


def batch_output(output_root, stem: str, dtype: str) -> str:
    """Where batch writes ``stem``'s output: the folder, or with ``<dtype>`` standing for the dtype while ``dtype`` is
    "auto" (the plan decides it; a failure raised after that carries the folder in ``output_planned``)."""
    from .dtypes import output_dtype

    chosen = output_dtype(dtype)
    return str(_output_path(output_root, stem, chosen.short if chosen is not None else "<dtype>"))


def _output_path(output_dir, stem: str, short_dtype: str) -> Path:
    """The default output: ``<output_dir or .>/<stem>-<dtype>``, ``~`` expanded."""
    return expanded_output(expanded(output_dir or ".", "output_dir") / f"{stem}-{short_dtype}", "output_dir")


@contextlib.contextmanager
def _naming(output: Path):
    """A failure from here on carries ``output_planned``: the folder this conversion was to write (batch reports it)."""
    try:
        yield
    except BaseException as error:
        if getattr(error, "output_planned", None) is None:
            error.output_planned = output
        raise


def _text(name):
    """A source or adapter as the API takes it (a str or an os.PathLike) in the str the rest of the code reads."""
    return os.fspath(name) if name is not None else None


def named_sources(source, adapter) -> tuple[str, str | None]:
    """``source`` and ``adapter`` as the API takes them (str or os.PathLike) in the str the rest of the code reads;
    ArgumentError for an empty one, which would otherwise be the current folder."""
    source, adapter = _text(source), _text(adapter)
    for name, value in (("source", source), ("adapter", adapter)):
        if value is not None and not value.strip():
            raise ArgumentError(f"{name} is empty; give a folder or a Hub repo id" + ("" if name == "source" else ", or None"),
                                option=name)  # fmt: skip
    return source, adapter


def _infinite_warning(names: list[str]) -> str | None:
    """What a conversion to fp16 says of the tensors it wrote with ±inf (values beyond fp16's range, 65504, in their
    source or made so by a merge; torch's cast and bitsandbytes make them so too)."""
    if not names:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"{len(names)} tensor{'s hold' if len(names) != 1 else ' holds'} ±inf in fp16, values beyond its range (65504): "
            f"{shown}; --dtype bf16 or fp32 keeps them finite")


def _plain_name(stem: str) -> bool:
    return isinstance(stem, str) and stem not in ("", ".", "..") and Path(stem).name == stem


@dataclass(frozen=True)
class Prepared:
    plan: object  # plan.Plan
    output: Path
    free_bytes: int
    base: str  # the base checkpoint as the user named it (SOURCE, or the base an adapter SOURCE names)
    adapter: str | None  # the adapter as the user named it
    revision: str | None = None  # the base's revision as the user gave it (None: the default branch)
    headers_only: str | None = None  # planned from its headers alone: the Hub repo as "repo@commit" (its copy is gone)


def not_bitsandbytes(config: dict) -> str | None:
    """Why a checkpoint's config.json says it holds no bitsandbytes weights, or None where it may hold some.

    transformers writes a ``quantization_config`` into config.json when it saves a quantized model; for bitsandbytes
    its ``quant_method`` is "bitsandbytes" with ``load_in_4bit`` or ``load_in_8bit`` (older versions wrote the
    flags without a ``quant_method``: not refused). With ``llm_int8_has_fp16_weight`` an 8-bit model keeps and saves
    its weights in fp16: bitsandbytes never quantized them."""
    found = []

    def visit(node):
        if isinstance(node, dict):
            if isinstance(node.get("quantization_config"), dict):
                found.append(node["quantization_config"])
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(config)
    if not found:
        return "config.json has no quantization_config: the weights are not quantized (already dense?)"
    methods = [q.get("quant_method") for q in found]
    if not any(not isinstance(m, str) or "bitsandbytes" in m.lower() for m in methods):
        return f"config.json's quantization_config has quant_method {methods[0]!r}, not bitsandbytes (not convertible here)"
    dense_int8 = [q for q in found if q.get("load_in_8bit") is True and q.get("llm_int8_has_fp16_weight") is True
                  and q.get("load_in_4bit") is not True]  # fmt: skip
    if len(dense_int8) == len(found):
        return ("saved with llm_int8_has_fp16_weight=True, so its weights are dense fp16 already (bitsandbytes never "
                "quantized them): remove quantization_config from config.json and load it as a dense model")  # fmt: skip
    return None


def _refuse_early(folder: Path, *, source: str) -> None:
    """A Hub SOURCE's precheck, on its config files alone: refuse before downloading weights when its config.json
    says it is not a bitsandbytes checkpoint. An adapter (its base is checked when fetched), a repo without
    config.json and a config.json that does not parse are left to the weights and the plan, as local folders are."""
    if (folder / "adapter_config.json").is_file() or not (folder / "config.json").is_file():
        return
    from .plan import read_config

    try:
        config = read_config(folder)  # strict and depth-limited, as the plan reads it
    except CheckpointError:
        return
    reason = not_bitsandbytes(config) if config is not None else None
    if reason is not None:
        raise CheckpointError(f"{source}: not a bitsandbytes checkpoint: {reason}; its weights were not downloaded")


def _reworded(error: CheckpointError, folder: Path) -> CheckpointError:
    """A plan's refusal of a local checkpoint, with the reason its config.json gives where it gives one (a model saved
    with ``llm_int8_has_fp16_weight`` has no 8-bit weights: that, not their absence, is what the user needs to know)."""
    from .plan import read_config

    try:
        config = read_config(folder)
    except CheckpointError:
        return error
    reason = not_bitsandbytes(config) if config is not None else None
    if reason is None or "llm_int8_has_fp16_weight" not in reason:
        return error
    return CheckpointError(f"{folder}: {reason}")


def resolve_source(source: str | os.PathLike, adapter: str | os.PathLike | None = None, *, revision=None, token=None,
                   cache_dir=None, progress=True, headers=None):  # fmt: skip
    """(checkpoint folder, adapter folder or None, the base's name, the adapter's name or None): SOURCE resolved,
    and ADAPTER; a SOURCE that is itself a peft adapter (``adapter_config.json``, no ADAPTER given) stands for
    the base its config names, with it merged (a folder that also holds model weights is a checkpoint).
    ``revision`` applies to SOURCE (a local folder has none); a Hub checkpoint whose config.json says it is not
    bitsandbytes is refused before its weights are downloaded; ``progress=False`` hides download bars; ``headers``
    (a ``hub.HeadersOnly``): the checkpoint's weights are not downloaded, its folder is their copy for a plan."""
    from .errors import SourceNotFoundError
    from .formats import peft_lora
    from .hub import resolve

    source, adapter = _text(source), _text(adapter)
    fetch = dict(token=token, cache_dir=cache_dir, progress=progress)
    folder = resolve(source, revision=revision, precheck=partial(_refuse_early, source=source), headers=headers, **fetch)
    adapter_folder = resolve(adapter, **fetch) if adapter is not None else None
    weights = [p for p in folder.glob("*.safetensors") if p.name != peft_lora.WEIGHTS_NAME]
    if adapter_folder is not None and (folder / peft_lora.CONFIG_NAME).is_file() and not weights:
        raise ArgumentError(f"{source} is a peft adapter (it has {peft_lora.CONFIG_NAME} and no model weights) and an "
                            "adapter is given too: give the base checkpoint as SOURCE", option="adapter")  # fmt: skip
    if adapter_folder is None and (folder / peft_lora.CONFIG_NAME).is_file() and not weights:
        base = peft_lora.load_adapter(folder).base_model_name_or_path
        if not base:
            raise SourceNotFoundError(f"{folder / peft_lora.CONFIG_NAME}: an adapter whose base_model_name_or_path is "
                                      "not set; name the base as SOURCE and this as the adapter", option="adapter")  # fmt: skip
        adapter_folder, folder = folder, resolve(base, precheck=partial(_refuse_early, source=base), headers=headers, **fetch)
        return folder, adapter_folder, base, str(adapter_folder.resolve()) if expanded(source, "source").exists() else source
    if adapter is not None and expanded(adapter, "adapter").exists():
        adapter = str(expanded(adapter, "adapter").resolve())  # a folder, never mistaken for a Hub repo id
    return folder, adapter_folder, source, adapter


def prepare(source: str | os.PathLike, output=None, *, dtype="auto", adapter=None, revision=None, token=None, cache_dir=None,
            max_shard_size=DEFAULT_SHARD_SIZE, overwrite=False, output_dir=None, stem=None, reader=None,
            progress=True, headers_only=False) -> Prepared:  # fmt: skip
    """Resolve and plan a conversion and check where it goes, writing nothing (what ``convert`` and a dry run do
    first). A Hub SOURCE's weights are downloaded into the Hub cache, unless ``headers_only`` (a dry run): then the
    plan reads their headers and quant states over range requests, from a copy removed before this returns (the
    plan can then be shown, not streamed; ``reader`` is not taken)."""
    if not headers_only:
        return _prepare(source, output, dtype=dtype, adapter=adapter, revision=revision, token=token, cache_dir=cache_dir,
                        max_shard_size=max_shard_size, overwrite=overwrite, output_dir=output_dir, stem=stem,
                        reader=reader, progress=progress)  # fmt: skip
    from .safetensors_io.read import TensorReader
    from .errors import Nf4ConvertError
    from .hub import HeadersOnly

    headers = HeadersOnly()
    try:
        with TensorReader(headers.ranges) as reader:
            return _prepare(source, output, dtype=dtype, adapter=adapter, revision=revision, token=token,
                            cache_dir=cache_dir, max_shard_size=max_shard_size, overwrite=overwrite, output_dir=output_dir,
                            stem=stem, reader=reader, progress=progress, headers=headers)  # fmt: skip
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


def _prepare(source, output, *, dtype, adapter, revision, token, cache_dir, max_shard_size, overwrite, output_dir, stem,
             reader, progress, headers=None) -> Prepared:  # fmt: skip
    from . import output as lifecycle
    from .dtypes import output_dtype
    from .plan import make_plan, parse_size

    knobs.check()  # a dry run refuses a bad NF4CONVERT_* value as the conversion does
    source, adapter = named_sources(source, adapter)
    if output is not None and (output_dir is not None or stem is not None):
        given = "output_dir" if output_dir is not None else "stem"
        raise ArgumentError(f"output and {given} both given: output names the folder itself, output_dir and stem name "
                            "it for you; give one or the other", option=given)  # fmt: skip
    if stem is not None and not _plain_name(stem):
        raise ArgumentError(f"stem {stem!r} is not a plain folder name (no '/', not '.' or '..')", option="stem")
    shard_limit = parse_size(max_shard_size)
    output_dtype(dtype)
    if output is not None:  # before any download
        output = expanded_output(output, "output")
        lifecycle.check_destination(output, overwrite=overwrite)
    folder, adapter_folder, base, adapter = resolve_source(source, adapter, revision=revision, token=token,
                                                           cache_dir=cache_dir, progress=progress, headers=headers)  # fmt: skip
    try:
        plan = make_plan(folder, dtype=dtype, max_shard_size=shard_limit, reader=reader, adapter=adapter_folder)
    except CheckpointError as error:
        reworded = _reworded(error, folder)
        if reworded is error:
            raise
        raise reworded from None
    named = output is None
    if named:
        output = _output_path(output_dir, stem or output_stem(source), plan.dtype.short)
    with _naming(output):
        if named:
            lifecycle.check_destination(output, overwrite=overwrite)
        lifecycle.check_not_source(output, folder)
        if adapter_folder is not None:
            lifecycle.check_not_source(output, adapter_folder)
        free_bytes = lifecycle.free_space(output)
    return Prepared(plan, output, free_bytes, base, adapter, revision if base == source else None,
                    headers and headers.shown(folder))  # fmt: skip


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
) -> ConvertResult:
    """Convert a bitsandbytes checkpoint (4-bit NF4/FP4 or 8-bit LLM.int8) into a dense safetensors checkpoint.

    ``output`` defaults to ``<output_dir or .>/<stem>-<dtype>``, the stem being the model's name without
    its quantization suffix (``stem`` a plain folder name; ``output`` and ``output_dir`` are not given together;
    ``~`` is expanded in ``source``, ``output`` and ``output_dir``). ``adapter`` (a folder or Hub repo id of a peft LoRA adapter) is merged into
    the weights it changes, bit for bit as peft's ``merge_and_unload`` on the dense model; a ``source``
    that is itself an adapter means its base with it merged. Nothing is written unless the whole output
    is: it appears under its name only once complete.

    Raises:
        ArgumentError: a bad ``dtype``, ``device``, ``max_shard_size`` or ``stem``, or ``output`` with ``output_dir``.
        SourceNotFoundError: ``source`` cannot be found or fetched.
        CheckpointError: the checkpoint is corrupt or not a bitsandbytes checkpoint, or the adapter does not fit it.
        OutputError: the output exists (and ``overwrite`` is off), the disk is too small, or writing failed.

    Example:
        >>> convert("unsloth/Llama-3.2-1B-Instruct-bnb-4bit", "llama-1b-bf16", dtype="bf16")
    """
    from tqdm.auto import tqdm

    from . import card as _card  # noqa: F401  (imported here, not first on the side thread: see _side_thread)
    from . import output as lifecycle
    from . import profile
    from .safetensors_io.read import TensorReader
    from .devices import pick_device
    from .stream import route_for, write_shards

    source = _text(source)
    started = time.perf_counter()
    profile.start("convert called")
    chosen_device = pick_device(device)
    profile.mark("device picked")
    # The route starts now (a CUDA context takes a while) and the card is written on the side while the tensors are.
    # From the move into place on, stop signals wait for the end (they are delivered marked with the complete OUT).
    finishing = contextlib.ExitStack()
    with finishing, route_for(chosen_device) as route, TensorReader() as reader, _side_thread() as side:
        prepared = prepare(source, output, dtype=dtype, adapter=adapter, revision=revision, token=token, cache_dir=cache_dir,
                           max_shard_size=max_shard_size, overwrite=overwrite, output_dir=output_dir, stem=stem,
                           reader=reader, progress=progress)  # fmt: skip
        plan, output = prepared.plan, prepared.output
        finishing.enter_context(_naming(output))  # a failure from here on names the output (batch reports it)
        profile.mark("planned")
        lifecycle.check_free_space(output, plan.tensor_bytes + plan.side_bytes)
        card = side.submit(model_card, prepared)
        with lifecycle.staging(output) as temporary:
            n_tensors = len(plan.tensors)
            with tqdm(total=plan.tensor_bytes, unit="B", unit_scale=True, unit_divisor=1000, disable=not progress,
                      desc=f"{model_name(source)} -> {plan.dtype.name}", dynamic_ncols=True) as bar:  # fmt: skip
                infinite = write_shards(plan, temporary, reader, chosen_device, progress=bar.update, route=route,
                                        tensor_done=lambda done: bar.set_postfix_str(f"{done}/{n_tensors} tensors",
                                                                                     refresh=False))  # fmt: skip
            profile.mark("tensors written")
            card = card.result()
            lifecycle.write_side_files(plan, temporary, card.text)
            finishing.enter_context(lifecycle.signals_held(output))
            lifecycle.move_into_place(temporary, output, overwrite=overwrite)
        profile.mark("in place")
        profile.report()
        result = ConvertResult(output, plan.dtype.name, len(plan.tensors), plan.n_dequantized, plan.tensor_bytes,
                               time.perf_counter() - started, tuple(w for w in [card.warning, _infinite_warning(infinite)] if w))  # fmt: skip
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
