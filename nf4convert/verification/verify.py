"""Check a converted checkpoint or GGUF against its source with the reference libraries, bit for bit: verify's one
front door.

verify is the conversion's sibling: it resolves and re-plans the source as the conversion does, then hands over to the
check of the output's kind: a folder (``folder.py``: the folder audited, every tensor recomputed by its kind's reference
library, ``reference/``, never our kernels or merge code, and compared) or a GGUF file (``gguf.py``: llama.cpp's
converter run on those references, its file compared). Both are checked against the same plan and reference ``Context``,
made here. The 4-bit reference on the CPU is ``reference/cuda_arithmetic.py``: bitsandbytes' CUDA arithmetic from
bitsandbytes' own parts, because its native CPU op differs from its CUDA kernels on some CPUs.
"""

from __future__ import annotations

import os
from pathlib import Path

from .. import preload, profile
from ..devices import pick_device
from ..errors import ArgumentError, CheckpointError
from ..formats.base import quantization_key
from ..hub.sources import named_sources, resolve_source
from ..hub.weights import HubWeights
from ..model.skeleton import meta_model, unloaded_parameters
from ..options import VerifyOptions, declared_fields, keyword_signature
from ..paths import expanded
from ..plan import make_plan
from ..safetensors_io.read import TensorReader, read_tensors
from .libraries import installed, quiet_loggers, reference_libraries, require, start_importing
from .outputs import output_for
from .reference.base import Context, libraries
from .report import VerifyReport


def _plan_source(folder: Path, output: Path, dtype, reader: TensorReader, adapter):
    try:
        return make_plan(folder, dtype=dtype, reader=reader, adapter=adapter)
    except CheckpointError:
        # OUT and SOURCE swapped: the "output" is the quantized checkpoint.
        try:
            swapped = next(filter(None, map(quantization_key, read_tensors(output))), None)
        except CheckpointError:
            swapped = None
        if swapped is not None:
            raise ArgumentError(
                f"{output} is a {swapped.family} checkpoint and {folder} is not: the order is OUT, then SOURCE"
            ) from None
        raise


def verify(output: str | Path, source: str, **options) -> VerifyReport:
    """Compare the converted checkpoint in ``output`` with ``source`` (and the LoRA ``adapter`` merged into it, by
    peft's own merge); mismatches go in the report, not exceptions. An ``output`` ending in ``.gguf`` is checked against
    llama.cpp's converter run on the reference (``gguf.py``; ``dtype``: the conversion's ``--dtype``, which only a GGUF
    needs: a folder's tensors say theirs). A Hub ``source``'s weights are read as ``convert`` reads them: streamed
    (``download``: downloaded into the Hub cache first), every byte checked against the Hub's hash of its file, with
    the ``NF4CONVERT_STREAM_*`` settings a conversion takes.

    ``options``: the keywords of ``options.VerifyOptions``, each as its command-line flag takes it (``nf4convert
    verify --help``): ``device="auto"``, ``adapter``, ``dtype="auto"``, ``progress=False``, ``revision``, ``token``,
    ``cache_dir``, ``download``.

    Raises:
        ArgumentError: a bad ``device``, an empty ``output``, ``source`` or ``adapter``, ``output`` and ``source``
            given the wrong way round, or a GGUF of a type nf4convert does not write.
        SourceNotFoundError: ``output`` is not a folder (a GGUF: not a file), or ``source`` cannot be found or fetched.
        CheckpointError: a file of ``output`` or ``source`` is corrupt, or ``source`` is not convertible.
        DependencyError: a reference library the source's weights need (bitsandbytes for its checkpoints, with an
            adapter peft, for a GGUF llama.cpp's converter) cannot be imported.

    Example:
        >>> report = verify("llama-1b-bf16", "unsloth/Llama-3.2-1B-Instruct-bnb-4bit")
        >>> report.ok
    """
    options = VerifyOptions.parse(**options)
    return verified(output, source, options)


def verified(output: str | Path, source: str, options: VerifyOptions, *, resolved=None, plan=None) -> VerifyReport:
    """``verify`` with its options parsed. ``resolved`` (``hub.sources.Resolved``) and ``plan``: this SOURCE (and
    adapter) as a conversion in this process resolved and planned it (``convert --verify``), taken instead of resolving
    and planning again (the plan only where it is in the output's dtype); the recomputing is verify's own all the same.

    The reference libraries begin importing on the preload thread (``libraries.start_importing``) once SOURCE is
    resolved, while it is planned and the output's headers read."""
    profile.start("verify called", enabled=options.settings.profile)
    source, adapter = named_sources(source, options.adapter)
    named = os.fspath(output)
    if not named.strip():
        raise ArgumentError("output is empty; give the converted checkpoint's folder", option="output")
    output = expanded(named, "output")
    checked = output_for(named)(output)  # its own checks, before SOURCE is fetched
    chosen = pick_device(options.device, kernel=False)  # bitsandbytes recomputes: no Triton needed
    report = VerifyReport(output, device=str(chosen), gguf=checked.gguf)
    hub, progress = options.hub, options.progress
    # a Hub SOURCE read as a conversion reads it: streamed, with the same settings, checked
    weights = HubWeights(download=hub.download, settings=options.settings)
    with quiet_loggers(), weights, TensorReader(weights.ranges, remote=weights.files) as source_reader:
        if resolved is None:
            resolved = resolve_source(source, adapter, hub, progress=progress, headers=weights)
        if resolved.adapter_folder is not None:
            installed("peft")
        # begun once SOURCE is here (a download imports huggingface_hub's parts: not beside transformers' import)
        start_importing(*checked.imports, *reference_libraries(resolved.adapter_folder is not None))
        if resolved.folder.resolve() == output.resolve():
            raise ArgumentError(
                f"{output} is given as both OUT and SOURCE: the order is the converted checkpoint, then "
                "the bitsandbytes one"
            )
        planned_in = checked.plan_dtype(options.dtype)
        if plan is None or plan.folder != resolved.folder or planned_in not in (None, plan.dtype):
            plan = _plan_source(resolved.folder, output, planned_in, source_reader, resolved.loaded_adapter)
        profile.mark("verify planned")
        require(libraries(plan.tensors), resolved.adapter_folder is not None)  # those the plan's references name
        preload.settled()  # from here this thread imports transformers' and the converter's parts itself
        profile.mark("reference libraries imported")
        planned = {tensor.name: tensor for tensor in plan.tensors}
        context = Context(planned, *meta_model(plan.config), (plan.merged and plan.merged.tied) or ())
        checked.check(
            report,
            plan,
            context,
            source_reader,
            chosen,
            progress=progress,
            source=source,
            revision=hub.revision,
            resolved=resolved,
        )
        report.problems += _unloaded(plan, report)
        weights.finish()  # what was compared is the commit's bytes
    profile.mark("compared")
    profile.report()
    return report


verify.__signature__ = keyword_signature(verify, declared_fields(VerifyOptions))


def _unloaded(plan, report: VerifyReport) -> list[str]:
    """The parameters transformers' model for the source's config would load with random values: neither the source
    nor therefore the output holds them (a shard or a weight missing from the checkpoint). A note where that cannot
    be told though the model was built."""
    if plan.config is None:
        return []  # no model to ask: said in the note on the missing config
    found = unloaded_parameters(plan.config, {tensor.name: tuple(tensor.shape) for tensor in plan.tensors})
    if isinstance(found, str):
        if not any("could not build the model" in note for note in report.notes):
            report.notes.append(f"which parameters transformers' model needs was not checked: {found}")
        return []
    model, missing = found
    return [_unloaded_problem(name, model, plan.source_tensors) for name in missing]


def _unloaded_problem(name: str, model: str, source_tensors) -> str:
    """What a parameter the output leaves to random values says: the output lacks it, and the source lacks it too,
    or holds it under that name (or a model's prefix before it: a base model's names lack the head's) and the
    conversion left it out."""
    held = [key for key in source_tensors if key == name or key.endswith("." + name)]
    if held:
        return (
            f"{name}: transformers' {model} has this parameter and the source holds it ('{held[0]}'), but the "
            "output lacks it (transformers would fill it with random values)"
        )
    return (
        f"{name}: transformers' {model} has this parameter, the source and the output lack it (transformers would "
        "fill it with random values)"
    )
