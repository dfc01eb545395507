"""Check a converted checkpoint against its source with the reference libraries, bit for bit.

verify is the conversion's sibling: it resolves and re-plans the source as the conversion does, recomputes every
recipe with bitsandbytes and peft (``reference/``, never our kernels or merge code), and compares the output's bytes
(``compare.py``); the folder as a whole is audited beside that (``audit.py``). The 4-bit reference on the CPU is
``reference/cuda_arithmetic.py``: bitsandbytes' CUDA arithmetic from bitsandbytes' own parts, because its native CPU
op differs from its CUDA kernels on some CPUs.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from ..devices import pick_device
from ..dtypes import DTYPES, OUTPUT_DTYPES
from ..errors import ArgumentError, CheckpointError, SourceNotFoundError
from ..formats.base import quantization_key
from ..hub.sources import named_sources, resolve_source
from ..paths import expanded
from ..plan import make_plan
from ..safetensors_io.read import TensorInfo, TensorReader, read_tensors
from ..skeleton import meta_model
from . import audit
from .compare import Tallies, described
from .libraries import quiet_loggers, reference_library
from .reference.base import Context
from .report import VerifyReport
from .stream import check_tensors


def _output_dtype(output: Path, produced: dict[str, TensorInfo]) -> str:
    """The output's dtype: that of most of its floating tensors (those of another are named one by one)."""
    codes = {dtype.code for dtype in OUTPUT_DTYPES.values()}
    counts = Counter(info.dtype for info in produced.values() if info.dtype in codes)
    if not counts:
        raise CheckpointError(f"{output}: no fp16, bf16 or fp32 tensors, so not a converted checkpoint")
    return DTYPES[counts.most_common(1)[0][0]].name


def _plan_source(folder: Path, output: Path, dtype: str, reader: TensorReader, adapter: Path | None):
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


def verify(
    output: str | Path,
    source: str,
    *,
    device: str = "auto",
    adapter: str | None = None,
    revision: str | None = None,
    token: str | None = None,
    cache_dir: str | None = None,
    progress: bool = False,
    dtype: str = "auto",
) -> VerifyReport:
    """Compare the converted checkpoint in ``output`` with ``source`` (and the LoRA ``adapter`` merged into it, by
    peft's own merge); mismatches go in the report, not exceptions. An ``output`` ending in ``.gguf`` is checked against
    llama.cpp's converter run on the reference (``gguf.verify_gguf``; ``dtype``: the conversion's ``--dtype``).

    Raises:
        ArgumentError: a bad ``device``, an empty ``output``, ``source`` or ``adapter``, or ``output`` and ``source``
            given the wrong way round.
        SourceNotFoundError: ``output`` is not a folder, or ``source`` cannot be found or fetched.
        CheckpointError: a file of ``output`` or ``source`` is corrupt, or ``source`` is not convertible.
        DependencyError: bitsandbytes (or, with an adapter, peft) cannot be imported.

    Example:
        >>> report = verify("llama-1b-bf16", "unsloth/Llama-3.2-1B-Instruct-bnb-4bit")
        >>> report.ok
    """
    from tqdm.auto import tqdm

    if os.fspath(output).lower().endswith(".gguf"):
        from .gguf import verify_gguf

        options = dict(adapter=adapter, revision=revision, token=token, cache_dir=cache_dir, progress=progress)
        return verify_gguf(output, source, device=device, dtype=dtype, **options)
    source, adapter = named_sources(source, adapter)
    output = os.fspath(output)
    if not output.strip():
        raise ArgumentError("output is empty; give the converted checkpoint's folder", option="output")
    output = expanded(output, "output")
    if not output.is_dir():
        raise SourceNotFoundError(f"{output}: {'a file, not a folder' if output.exists() else 'no such folder'}")
    chosen = pick_device(device, kernel=False)  # bitsandbytes recomputes: no Triton needed
    with quiet_loggers():
        reference_library("bitsandbytes")
        folder, adapter_folder, _, _ = resolve_source(
            source, adapter, revision=revision, token=token, cache_dir=cache_dir, progress=progress
        )
        if adapter_folder is not None:
            reference_library("peft")
        if folder.resolve() == output.resolve():
            raise ArgumentError(
                f"{output} is given as both OUT and SOURCE: the order is the converted checkpoint, then "
                "the bitsandbytes one"
            )
        return _verify(output, folder, adapter_folder, chosen, progress, tqdm)


def _verify(output: Path, folder: Path, adapter_folder, chosen, progress: bool, tqdm) -> VerifyReport:
    report = VerifyReport(output, device=str(chosen))
    with TensorReader() as source_reader, TensorReader() as output_reader:
        produced = read_tensors(output)
        plan = _plan_source(folder, output, _output_dtype(output, produced), source_reader, adapter_folder)
        report.problems += audit.weight_file_problems(output, produced)
        report.problems += audit.leftovers(produced, output, plan.config)
        report.problems += audit.carried_problems(plan, output)
        report.problems += audit.unexpected_files(plan, output, produced)
        report.problems += audit.metadata_problems(produced)
        expected = {tensor.name: tensor for tensor in plan.tensors}
        report.problems += [
            f"{name}: in the source, missing from the output" for name in sorted(set(expected) - set(produced))
        ]
        report.problems += [
            f"{name}: in the output, not in the source" for name in sorted(set(produced) - set(expected))
        ]
        names = sorted(set(expected) & set(produced))
        context = Context(expected, *meta_model(plan.config), plan.tied or ())
        report.problems += audit.layout_problems(plan.tensors, context)
        retyped = {name: described(expected[name], produced[name]) for name in names}
        # in the output's order: each file read front to back
        pairs = sorted(
            ((expected[name], produced[name]) for name in names if retyped[name] is None),
            key=lambda pair: (str(pair[1].path), pair[1].begin),
        )
        tallies = Tallies()
        with tqdm(
            total=sum(info.nbytes for _, info in pairs),
            desc=f"verifying {output.name}",
            unit="B",
            unit_scale=True,
            disable=not progress,
            dynamic_ncols=True,
        ) as bar:
            check_tensors(pairs, source_reader, output_reader, chosen, context, tallies, bar.update)
        for name in names:
            report.checked += 1
            tally = tallies.by_name.get(name)
            if tally is not None:
                report.compared_against[name] = tally.against
                if not expected[name].recipe.plain:
                    report.dequantized += 1
                    report.merged += expected[name].recipe.kind == "merge_lora"
            problem = retyped[name] or (tally.problem() if tally is not None else None)
            if problem:
                report.problems.append(f"{name}: {problem}")
    if adapter_folder is None and audit.looks_merged(report.problems):
        report.notes.append(
            "the output looks merged with an adapter (weights of the source's dtype and shape, other values, or a "
            "head the tied source lacks); if it was, pass that adapter with --adapter"
        )
    if plan.config is None:
        report.notes.append(
            "config.json: the source has none and the output neither, so transformers cannot load the output as a "
            "model; the shapes it would load and its Conv1D layers were not checked"
        )
    elif context.unbuilt() is not None:
        report.notes.append(
            f"config.json: transformers could not build the model from it ({context.unbuilt()}), so the "
            "shapes it loads and its Conv1D layers were not checked"
        )
    return report
