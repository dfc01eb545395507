"""verify beside a push with no local copy (``convert --verify --push-to-hub REPO --no-local-copy``): each shard the
conversion finishes is compared, tensor by tensor, with its reference before it is uploaded, so a mismatch stops the
run with nothing further uploaded and nothing committed.

As ``verify.py`` does for a folder, SOURCE is resolved, planned (in the shards' own dtype, read from the first one)
and read again on verify's own: a Hub SOURCE is streamed a second time, never read through the conversion's code. The
folder's audit of the whole (its files, metadata, the shapes transformers loads) needs the finished folder, which
this mode never has: the shards' tensors are what is checked.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from .. import preload
from ..devices import pick_device
from ..errors import Nf4ConvertError
from ..hub.sources import named_sources, resolve_source
from ..hub.weights import HubWeights
from ..model.skeleton import meta_model
from ..options import VerifyOptions
from ..plan import make_plan
from ..safetensors_io.read import TensorReader, read_header
from .compare import Tallies, described
from .finite import made_by_merge
from .folder import tensors_dtype
from .libraries import installed, quiet_loggers, reference_libraries, require, start_importing
from .reference.base import Context, libraries
from .report import VerifyReport
from .stream import check_tensors


class ShardMismatch(Nf4ConvertError):
    """A finished shard differs from its reference (or could not be checked): the push stops before uploading it."""


class ShardChecks:
    """The checks of one run's shards, as a context manager (SOURCE's reads open while it lasts); ``check(path)`` for
    each shard, ``report`` at the end."""

    def __init__(self, source: str, options: VerifyOptions, shown: str):
        """``shown``: what the report names as the output (the repo pushed to)."""
        self.source, self.adapter = named_sources(source, options.adapter)
        self.options = options
        self.device = pick_device(options.device, kernel=False)  # bitsandbytes recomputes: no Triton needed
        self.report = VerifyReport(Path(shown), device=str(self.device))
        self.context = None
        self.checked: set[str] = set()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "ShardChecks":
        self.weights = self._stack.enter_context(
            HubWeights(download=self.options.hub.download, settings=self.options.settings)
        )
        self._stack.enter_context(quiet_loggers())
        self.reader = self._stack.enter_context(TensorReader(self.weights.ranges, remote=self.weights.files))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _ready(self, produced: dict, path: Path) -> None:
        """SOURCE resolved and planned in the dtype of the shards, the reference libraries imported."""
        resolved = resolve_source(self.source, self.adapter, self.options.hub, progress=False, headers=self.weights)
        self.resolved = resolved
        if resolved.adapter_folder is not None:
            installed("peft")
        start_importing(*reference_libraries(resolved.adapter_folder is not None))
        dtype = tensors_dtype(path, produced)
        plan = make_plan(resolved.folder, dtype=dtype, reader=self.reader, adapter=resolved.loaded_adapter)
        require(libraries(plan.tensors), resolved.adapter_folder is not None)
        preload.settled()
        self.planned = {tensor.name: tensor for tensor in plan.tensors}
        self.context = Context(self.planned, *meta_model(plan.config), (plan.merged and plan.merged.tied) or ())

    def check(self, path: Path) -> None:
        """Compare every tensor of the shard ``path`` with its reference; ShardMismatch naming the first problem."""
        produced, _ = read_header(path)
        if self.context is None:
            self._ready(produced, path)
        expected, report = self.planned, self.report
        problems = [f"{name}: in the output, not in the source" for name in sorted(set(produced) - set(expected))]
        names = sorted(set(produced) & set(expected))
        retyped = {name: described(expected[name], produced[name]) for name in names}
        pairs = sorted(
            ((expected[name], produced[name]) for name in names if retyped[name] is None),
            key=lambda pair: pair[1].begin,
        )
        tallies = Tallies()
        with TensorReader() as output_reader:
            check_tensors(pairs, self.reader, output_reader, self.device, self.context, tallies, lambda count: None)
        for name in names:
            report.checked += 1
            self.checked.add(name)
            tally = tallies.by_name.get(name)
            if tally is not None:
                report.compared_against[name] = tally.against
                if not expected[name].recipe.plain:
                    report.dequantized += 1
                    report.merged += expected[name].recipe.merges_adapter
            problem = retyped[name] or (tally.problem() if tally is not None else None)
            if not problem and tally is not None and tally.non_finite:
                merged = self.context.recompute(expected[name], self.reader, self.device)
                problem = made_by_merge(expected[name], merged, self.reader, self.device, self.context)
            if problem:
                problems.append(f"{name}: {problem}")
        if problems:
            report.problems += problems
            more = f" ({len(problems)} problems, the first)" if len(problems) > 1 else ""
            raise ShardMismatch(f"{path.name}: verification failed{more}: {problems[0]}")

    def finish(self, skipped: int) -> VerifyReport:
        """The report once every shard made was checked (``skipped``: tensors of shards the Hub held already, made
        and uploaded by an earlier run, not checked again), every byte read checked against the Hub's hash."""
        self.weights.finish()
        if skipped:
            self.report.notes.append(
                f"{skipped} tensors in shards the Hub held already (an earlier run's) were not made or checked again"
            )
        return self.report
