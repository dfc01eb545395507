"""What a command runs, as API functions that return result objects: a conversion and what follows it (verify, the
push), and a batch of conversions (a row per source, a summary). The command line only parses, calls and renders.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from .. import preload
from ..conversion import ConvertResult, Prepared, converted, prepare
from ..devices import pick_device
from ..dtypes import BY_NAME
from ..errors import Interrupted, Nf4ConvertError, Terminated, UploadError
from ..options import ConvertOptions, VerifyOptions
from ..paths import expanded_output
from ..sinks import output as lifecycle
from ..sinks.base import SINKS, sink_for
from ..sinks.gguf.converter import is_quantized
from ..sinks.naming import batch_stems, check_batch_root
from ..verification.report import VerifyReport


@dataclass
class Pushed:
    """A finished output uploaded to the Hub."""

    url: str


def dry_run_plan(source, options: ConvertOptions, *, on_output=None, placed=True) -> Prepared:
    """Plan a conversion without writing anything (a Hub SOURCE's weights are not downloaded): what a conversion would
    refuse, this refuses too (a ``device`` that is not there, an output that exists; ``placed`` False: a push with no
    local copy, whose OUT is never made)."""
    pick_device(options.device)
    return prepare(source, options, headers_only=True, on_output=on_output, placed=placed)


def check_room(output, needed: int, free: int | None = None) -> None:
    """OutputError unless the file system ``output`` goes to has room for ``needed`` bytes of output, by the
    conversion's own rule (``free``: its free bytes, as a dry run measured them): a dry run, once it has shown its
    plan, refuses what the conversion would."""
    lifecycle.check_free_space(expanded_output(output, "output"), needed, free)


def convert_then(
    source,
    options: ConvertOptions,
    *,
    verify: bool = False,
    push_to: str | None = None,
    private: bool = False,
    push_branch: str | None = None,
    on_step: Callable[[object], None] = lambda result: None,
    no_local_copy: bool = False,
    again: str | None = None,
) -> bool:
    """Convert, then verify the output (if asked), then push it (if asked and verified); each step's result
    (``ConvertResult``, ``VerifyReport``, :class:`Pushed`) goes to ``on_step`` as it comes. Whether every step passed.
    A stop signal after the output was complete says so (``output_complete``): it is kept.

    ``no_local_copy`` (with ``push_to``): the output goes to the Hub as it is made (``hub/push.py``), the Hub and the
    repo checked before anything is converted; ``again`` is the command a failed push says finishes the job.

    With ``verify``, the reference libraries begin importing on the side as the conversion starts, and verify takes
    SOURCE as the conversion resolved and planned it."""
    then_importing = ()
    if verify and is_quantized(options.gguf_type):  # llama.cpp's quantizer is there, before anything is converted
        from ..verification.llama_quantize import find

        find(options.gguf_type, options.imatrix is not None)
    if verify:
        from ..verification.libraries import importing, reference_libraries

        then_importing = importing(*reference_libraries(options.adapter is not None))
    if push_to and no_local_copy:
        return _pushed_as_made(source, options, verify, push_to, private, push_branch, on_step, again, then_importing)
    if push_to:
        from ..hub.upload import check_ready

        check_ready(push_to, token=options.hub.token, private=private, progress=options.progress)
    with preload.allowed():
        result: ConvertResult = converted(source, options, then_importing=then_importing)
    try:
        on_step(result)
        if verify:
            prepared = result.prepared
            if prepared is not None and prepared.hub_weights is not None:
                prepared = None  # a streamed SOURCE is streamed again: no copy of its weights was kept
            report = verify_output(
                result.output,
                source,
                VerifyOptions.of(options, made_dtype(result)),
                resolved=prepared and prepared.resolved,
                plan=prepared and prepared.plan,
            )
            on_step(report)
            if not report.ok:
                return False
        if push_to:
            sink = SINKS[result.sink]
            try:
                url = sink.push(
                    result.output,
                    push_to,
                    card=result.card,
                    private=private,
                    token=options.hub.token,
                    revision=push_branch,
                    progress=options.progress,
                )
            except UploadError as error:  # the output stays: say so, and how to push it once the cause is gone
                kept = f"{result.output} is complete and kept"
                if error.option != "private":  # a public repo refused for --private: a plain upload would fill it
                    again = sink.push_again(
                        result.output, push_to, card=result.card, private=private, branch=push_branch
                    )
                    kept = f"{kept}; {again}"
                raise UploadError(f"{error}; {kept}", option=error.option) from error
            on_step(Pushed(url))
    except (Interrupted, Terminated) as stop:
        stop.output_complete = stop.output_complete or result.output
        raise
    return True


def _pushed_as_made(source, options, verify, push_to, private, push_branch, on_step, again, then_importing) -> bool:
    """``convert_then`` with no local copy (``hub/push.py``): the Hub, the token and the repo checked before any
    work, each shard (verified first, with ``verify``: ``verification/shards.py``) uploaded as it is made, one commit
    at the end; the results as ``convert_then`` gives them."""
    import contextlib

    from ..hub.push import HubPush

    pushing = HubPush(
        push_to,
        private=private,
        token=options.hub.token,
        branch=push_branch,
        overwrite=options.overwrite,
        progress=options.progress,
        on_disk=options.settings.push_on_disk,
        again=again,
    )
    pushing.open()
    checks = contextlib.nullcontext()
    if verify:
        from ..verification.shards import ShardChecks

        checks = ShardChecks(source, VerifyOptions.of(options), shown=push_to)
    try:
        with checks, preload.allowed():
            if verify:
                pushing.check = checks.check
            result: ConvertResult = converted(source, options, then_importing=then_importing, pushing=pushing)
            report = checks.finish(result.tensors - len(checks.checked)) if verify else None
    except (Interrupted, Terminated) as stop:
        stop.pushed = pushing.kept()  # the line a stop ends with: what is on the Hub, and the command that finishes
        raise
    on_step(result)
    if report is not None:
        on_step(report)
    on_step(Pushed(result.pushed.url))
    return True


def verify_output(output, source, options: VerifyOptions, *, resolved=None, plan=None) -> VerifyReport:
    """``verification.verify`` of ``output`` against ``source``, with huggingface_hub's download bars shown or hidden
    as ``options.progress`` says (``resolved``, ``plan``: as a conversion of the same SOURCE made them, see
    ``verified``); its libraries imported on the side while it resolves and plans."""
    from ..hub.download import progress_bars
    from ..verification.verify import verified

    with progress_bars(options.progress), preload.allowed():
        return verified(output, source, options, resolved=resolved, plan=plan)


@dataclass
class Row:
    """One source of a batch, as the table and ``--json`` show it."""

    source: str
    output: str | None
    status: str = "failed"  # ok, verified, skipped, planned, failed, interrupted, not attempted
    error: str | None = None
    tensors: int | None = None
    bytes: int | None = None
    seconds: float | None = None
    existing: bool = False  # its output was there before the batch (skip_existing): skipped, or verified as it is
    warnings: list[str] = field(default_factory=list)  # this source's own (the shared folder's are said once)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class BatchResult:
    rows: list[Row] = field(default_factory=list)
    stopped: BaseException | None = None  # the stop signal that ended the batch (the rest not attempted)
    needed: int = 0  # a dry run's bytes to write, all planned sources together
    free: int | None = None  # a dry run's free bytes where the outputs go

    @property
    def failed(self) -> int:
        done = {"ok", "verified", "skipped", "planned"}
        return sum(row.status not in done for row in self.rows)

    @property
    def untried(self) -> list[str]:
        return [row.source for row in self.rows if row.status == "not attempted"]


def read_source_list(text: str) -> list[str]:
    """The sources a ``--from-file`` list names, one a line: ``#`` at a line's start or after whitespace begins a
    comment (one inside a path, ``h#1/x``, is the path's)."""
    listed = [re.sub(r"(?:^|\s)#.*", "", line).strip() for line in text.splitlines()]
    return [source for source in listed if source]


def batch(
    sources: list[str],
    output_root,
    options: ConvertOptions,
    *,
    dry_run: bool = False,
    skip_existing: bool = False,
    verify: bool = False,
    on_error: Callable[[Row, Exception], None] = lambda row, error: None,
    on_warning: Callable[[str, str], None] = lambda source, warning: None,
) -> BatchResult:
    """Convert (or with ``dry_run`` plan) each source into ``output_root`` as ``options`` say, going on past failures;
    a stop signal ends the batch (the sources after it are "not attempted"). ``skip_existing``: a source whose output
    is there already is "skipped" (not converted, not a failure), or with ``verify`` verified as it is; ``verify``: each
    output is verified once converted ("verified"; a mismatch fails the row, the output kept). Each output is named
    as its sink names a batch's (``<output_root>/<name>-<dtype>``, a GGUF ``<name>-<type>.gguf``).
    ``on_error(row, error)`` sees each failed row as it fails (and may reword its ``error``), ``on_warning(source,
    warning)`` each conversion's warnings as they come: every source's own, and those of the folder the outputs share
    (its killed runs' leftovers) once."""
    check_batch_root(output_root, [*sources, options.adapter])
    sink = sink_for(options)
    planned = [(stem, sink.batch_output(output_root, stem, options)) for stem in batch_stems(sources)]
    result = BatchResult()
    said = set()

    def warn_once(source: str, warning: str) -> None:  # the outputs share a folder, and its killed runs' leftovers
        if warning not in said:
            said.add(warning)
            on_warning(source, warning)

    done = "planned" if dry_run else "ok"
    root = expanded_output(output_root, "output")
    for source, (stem, output) in zip(sources, planned):
        started = time.perf_counter()
        row = Row(source, output)

        def named(folder: Path, row=row) -> None:
            row.output = str(folder)

        try:
            own = options.replace(output=None, output_dir=root, stem=stem)
            found = _existing(source, output, own, named, file=sink.file) if skip_existing else None
            if found is not None:
                row.output, row.existing = str(found), True
                row.tensors = _verified(found, source, own) if verify else None
                row.status = "verified" if verify else "skipped"
            elif dry_run:
                prepared = dry_run_plan(source, own, on_output=named)
                plan = prepared.plan
                row.status, row.tensors, row.bytes = done, len(plan.tensors), plan.tensor_bytes
                result.needed += prepared.needed
                result.free = prepared.free_bytes
                for leftover in prepared.leftovers:
                    warn_once(source, leftover.note())
            else:
                made = converted(source, own, on_output=named)
                row.output, row.status, row.tensors, row.bytes = str(made.output), done, made.tensors, made.bytes
                for warning in made.warnings:
                    row.warnings.append(warning)
                    on_warning(source, warning)
                if verify:
                    try:
                        _verified(made.output, source, own, made_dtype(made))
                    except (Interrupted, Terminated) as stop:  # the output was complete: it is kept, and ok
                        stop.output_complete = stop.output_complete or made.output
                        raise
                    row.status = "verified"
        except (Interrupted, Terminated, KeyboardInterrupt) as stop:
            row.status = row.error = "interrupted"
            result.stopped = stop
            if getattr(stop, "output_complete", None):
                row.output, row.status = str(stop.output_complete), "ok"
        except Exception as error:  # noqa: BLE001  (one source's failure, whatever it is, must not stop the others)
            row.status = "failed"  # a verification that failed after the conversion, too
            row.error = (
                str(error) if isinstance(error, Nf4ConvertError) else f"internal error: {type(error).__name__}: {error}"
            )
            on_error(row, error)
        row.seconds = round(time.perf_counter() - started, 1)
        result.rows.append(row)
        if result.stopped is not None:
            break
    result.rows += [Row(source, None, "not attempted") for source in sources[len(result.rows) :]]
    return result


class _Existing(Exception):
    """A batch output found there already (raised from ``on_output`` to stop a plan as soon as its output is known)."""

    def __init__(self, folder: Path):
        super().__init__(str(folder))
        self.folder = folder


def _existing(source: str, output: str, options: ConvertOptions, told, *, file: bool) -> Path | None:
    """A batch source's output if it is there already (``file``: the output is one file): named in advance where the
    dtype is given; else, as the plan of the source's headers names it (a Hub repo's weights are not downloaded to
    learn it)."""
    if "<dtype>" not in output:
        return Path(output) if lifecycle.holds_output(Path(output), file=file) else None

    def named(folder: Path) -> None:
        told(folder)
        if lifecycle.holds_output(folder, file=file):
            raise _Existing(folder)

    try:
        dry_run_plan(source, options, on_output=named)
    except _Existing as found:
        return found.folder
    return None


def _verified(output, source: str, options: ConvertOptions, dtype=None) -> int:
    """Verify a batch's output (``dtype``: the DType it was made in, None: as a conversion chooses); the tensors
    checked, or Nf4ConvertError naming the first mismatch (the output stays)."""
    report = verify_output(output, source, VerifyOptions.of(options, dtype))
    if not report.ok:
        count = len(report.problems)
        raise Nf4ConvertError(
            f"{output}: verification failed ({count} problem{'s' if count != 1 else ''}, the first: "
            f"{report.problems[0]}); the output is kept"
        )
    return report.checked


def made_dtype(result: ConvertResult):
    """The DType a conversion made its tensors in."""
    return BY_NAME[result.dtype]
