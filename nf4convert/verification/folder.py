"""verify for a folder OUT: the converted checkpoint audited as a whole (``audit.py``: its files, leftovers, metadata,
the shapes transformers loads) and every tensor compared, streamed, with its reference (``stream.py``).

The front door (``verify.py``) has resolved SOURCE, chosen the device, checked the reference libraries and planned the
source in the output's dtype; this reads the output and compares.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..dtypes import DTYPES, OUTPUT_DTYPES, DType
from ..errors import ArgumentError, CheckpointError, SourceNotFoundError
from ..safetensors_io.read import TensorInfo, TensorReader, read_tensors
from . import audit, hints
from .compare import Tallies, described
from .finite import made_by_merge
from .outputs import Output, register
from .stream import check_tensors


@register
class Folder(Output):
    """A converted checkpoint's folder, as verify checks it: whatever OUT is not another kind's."""

    name = "folder"
    default = True

    def __init__(self, output: Path):
        if not output.is_dir():
            raise SourceNotFoundError(f"{output}: {'a file, not a folder' if output.exists() else 'no such folder'}")
        self.output = output
        self.produced: dict[str, TensorInfo] = {}

    def plan_dtype(self, dtype):
        """The dtype the source is planned in (a ``DType``): the output's own, from its headers. ``dtype`` is a GGUF's
        option (its tensors' dtype before the GGUF type): given for a folder, it must be the folder's own."""
        self.produced = read_tensors(self.output)
        own = tensors_dtype(self.output, self.produced)
        if dtype is not None and dtype != own:
            raise ArgumentError(
                f"{self.output}: its tensors are {own.name}, not {dtype.name} (dtype is a GGUF's: the dtype its "
                "tensors were made in; a folder's tensors say their own)",
                option="dtype",
            )
        return own

    def check(self, report, plan, context, source_reader, device, *, progress: bool, source, revision, resolved):
        """Audit the output and compare each of its tensors with the reference of the planned one; what differs, and
        what could not be checked, goes in ``report`` (``source`` and ``revision``, as named, are not needed)."""
        from tqdm.auto import tqdm

        output, produced, expected = self.output, self.produced, context.planned
        with TensorReader() as output_reader:
            report.problems += audit.weight_file_problems(output, produced)
            report.problems += audit.leftovers(produced, output, plan.config)
            report.problems += audit.carried_problems(plan, output)
            report.problems += audit.unexpected_files(plan, output, produced)
            report.problems += audit.metadata_problems(produced)
            report.problems += [
                f"{name}: in the source, missing from the output" for name in sorted(set(expected) - set(produced))
            ]
            report.problems += [
                f"{name}: in the output, not in the source" for name in sorted(set(produced) - set(expected))
            ]
            names = sorted(set(expected) & set(produced))
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
                check_tensors(pairs, source_reader, output_reader, device, context, tallies, bar.update)
            for name in names:
                report.checked += 1
                tally = tallies.by_name.get(name)
                if tally is not None:
                    report.compared_against[name] = tally.against
                    if not expected[name].recipe.plain:
                        report.dequantized += 1
                        report.merged += expected[name].recipe.merges_adapter
                problem = retyped[name] or (tally.problem() if tally is not None else None)
                if not problem and tally is not None and tally.non_finite:
                    merged = context.recompute(expected[name], source_reader, device)
                    problem = made_by_merge(expected[name], merged, source_reader, device, context)
                if problem:
                    report.problems.append(f"{name}: {problem}")
        elsewhere = hints.not_from_source(
            {name: tuple(tensor.shape) for name, tensor in expected.items()},
            {name: tuple(info.shape) for name, info in produced.items()},
            report.problems,
        )
        if elsewhere is not None:
            report.notes.append(elsewhere)
        elif resolved.adapter_folder is None and hints.looks_merged(report.problems):
            report.notes.append(hints.ADAPTER_HINT)
        if plan.config is None:
            report.notes.append(
                "config.json: the source has none and the output neither, so transformers cannot load the output as a "
                "model; the shapes it would load and its Conv1D layers were not checked"
            )
        elif context.unbuilt() is not None:
            report.notes.append(
                f"config.json: transformers could not build the model from it ({context.unbuilt()}), so the "
                "parameters it needs, the shapes it loads and its Conv1D layers were not checked"
            )


def tensors_dtype(output: Path, produced: dict[str, TensorInfo]) -> DType:
    """The output's dtype: that of most of its floating tensors (those of another are named one by one)."""
    codes = {dtype.code for dtype in OUTPUT_DTYPES.values()}
    counts = Counter(info.dtype for info in produced.values() if info.dtype in codes)
    if not counts:
        raise CheckpointError(f"{output}: no fp16, bf16 or fp32 tensors, so not a converted checkpoint")
    return DTYPES[counts.most_common(1)[0][0]]
