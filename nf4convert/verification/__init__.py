"""Check a converted checkpoint against its source with the reference libraries, bit for bit.

verify is the conversion's sibling: it resolves and re-plans the source as the conversion does, recomputes every
recipe with bitsandbytes and peft (``reference/``, never our kernels or merge code), and compares the output's bytes
(``compare.py``); the folder as a whole is audited beside that (``audit.py``). The 4-bit reference on the CPU is
``reference/cuda_arithmetic.py``: bitsandbytes' CUDA arithmetic from bitsandbytes' own parts, because its native CPU
op differs from its CUDA kernels on some CPUs.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..devices import pick_device
from ..dtypes import DTYPES, OUTPUT_DTYPES
from ..errors import ArgumentError, CheckpointError, DependencyError, SourceNotFoundError
from ..formats import bnb4_weights, bnb8
from ..paths import expanded
from ..plan import make_plan
from ..safetensors_io.read import TensorInfo, TensorReader, read_tensors
from ..skeleton import meta_model
from ..source import named_sources, resolve_source
from . import audit
from .compare import Tallies, described
from .reference import Context
from .stream import check_tensors


@dataclass
class VerifyReport:
    output: Path
    checked: int = 0
    dequantized: int = 0  # tensors recomputed by the reference libraries (not plain copies)
    merged: int = 0  # of which an adapter's change was merged by peft
    device: str = "cpu"
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # checks that could not run (not problems: the weights may be right)
    compared_against: dict[str, str] = field(default_factory=dict)  # tensor -> what it was compared against
    gguf: bool = False  # a GGUF file, checked against llama.cpp's converter run on the reference

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def against(self) -> Counter:
        """How many tensors were compared against each reference ("bitsandbytes", "the source tensor", ...)."""
        return Counter(self.compared_against.values())

    @property
    def libraries(self) -> str:
        """What the recomputed tensors were compared against, together ("bitsandbytes and peft")."""
        if self.gguf:  # every tensor went through the converter, run on the reference libraries' tensors
            return "llama.cpp's converter on " + ("bitsandbytes and peft" if self.merged else "bitsandbytes")
        names = []
        for what in sorted(self.against):
            for part in what.split(" + "):
                if part != "the source tensor" and part not in names:
                    names.append(part)
        return " and ".join(names) or "the source tensors"


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
        # OUT and SOURCE swapped: the "output" is the bitsandbytes checkpoint.
        try:
            swapped = any(
                bnb4_weights.STATE_KEY.match(name) or name.endswith(f".{bnb8.PARTS[0]}")
                for name in read_tensors(output)
            )
        except CheckpointError:
            swapped = False
        if swapped:
            raise ArgumentError(
                f"{output} is a bitsandbytes checkpoint and {folder} is not: the order is OUT, then SOURCE"
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
    with _quiet_loggers():
        _reference_library("bitsandbytes")
        folder, adapter_folder, _, _ = resolve_source(
            source, adapter, revision=revision, token=token, cache_dir=cache_dir, progress=progress
        )
        if adapter_folder is not None:
            _reference_library("peft")
        if folder.resolve() == output.resolve():
            raise ArgumentError(
                f"{output} is given as both OUT and SOURCE: the order is the converted checkpoint, then "
                "the bitsandbytes one"
            )
        return _verify(output, folder, adapter_folder, chosen, progress, tqdm)


@contextlib.contextmanager
def _quiet_loggers():
    """bitsandbytes warns on import about an optional CPU matmul kernel that verification never uses, and peft about
    the stand-in models it is handed (in its log and as Python warnings: a config key it does not know, a layer class
    it adjusts fan_in_fan_out for): quiet while verifying, as the caller had them after."""
    import logging
    import warnings

    loggers = [logging.getLogger(name) for name in ("bitsandbytes.backends.cpu.ops", "peft")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"peft(\.|$)")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _reference_library(name: str) -> None:
    """DependencyError unless ``name`` imports: without its reference library verify can recompute nothing, which is
    not a difference in the weights."""
    import importlib

    try:
        importlib.import_module(name)
    except Exception as error:  # noqa: BLE001  (ImportError, or a broken install failing inside its import)
        what = "LoRA merges (peft's own merge)" if name == "peft" else "the weights (bitsandbytes' dequantization)"
        raise DependencyError(
            f"verify recomputes {what} with {name}, which cannot be imported ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); install it: pip install {name}"
        ) from None


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


def report_lines(report: VerifyReport) -> list[str]:
    """The report as the command prints it: what was compared against what, each problem, the verdict."""
    compared = ", ".join(
        f"{count} against {'their source tensors' if what == 'the source tensor' else what}"
        for what, count in sorted(report.against.items())
    )
    if report.gguf:
        compared = f"{report.dequantized} recomputed by {report.libraries}"
    lines = [
        f"{report.output}: {report.checked} tensors checked on {report.device}" + (f" ({compared})" if compared else "")
    ]
    lines += [f"  MISMATCH {problem}" for problem in report.problems[:20]]
    if len(report.problems) > 20:
        lines.append(f"  ... and {len(report.problems) - 20} more problems")
    lines += [f"  note: {note}" for note in report.notes]
    count = len(report.problems)
    lines.append(
        f"OK: bit-exact with {report.libraries}" if report.ok else f"FAILED: {count} problem{'s' if count != 1 else ''}"
    )
    return lines
