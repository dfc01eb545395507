"""What every output format answers, and the registry of them: the conversion, the batch, the dry run and the push ask
a sink, never which output it is.

A sink is one class, registered where it is defined (``@register``) and found by importing every module of this
package (``all_sinks``). Adding an output format is adding a module here with a ``Sink`` subclass; nothing else
changes. A sink is chosen from the options before anything is read (``sink_for``), then made for the plan
(``for_plan``: the sink of this conversion, which knows what it will write).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar

from ..errors import ArgumentError
from ..options import DISCOVERIES, declare
from ..registry import Registry

if TYPE_CHECKING:
    from ..options import ConvertOptions
    from ..plan import Plan
    from ..safetensors_io.read import TensorReader
    from ..settings import Settings

SINKS = Registry(__package__, "output format", "name")
register = SINKS.register  # class decorator: the sink joins the registry under its ``name``


def all_sinks() -> list[type["Sink"]]:
    """Every registered sink, the ones that claim outputs by their options first and the default (the folder) last."""
    return sorted(SINKS.discovered().values(), key=lambda sink: sink.default)


def declared_options() -> None:
    """Import each sink's option declarations, not the sinks: a sink declares its own options (``options.declare``)
    in a light module of its own, ``options.py`` in its wing (``sinks/gguf/options.py``), which ``--help`` and the
    options' parsing import without the sink's heavier ones."""
    import importlib
    import importlib.util
    import pkgutil

    for found in pkgutil.iter_modules(importlib.import_module(__package__).__path__):
        name = f"{__package__}.{found.name}.options"
        if found.ispkg and importlib.util.find_spec(name) is not None:
            importlib.import_module(name)


DISCOVERIES.append(declared_options)


def _lowered(name):
    return name.lower() if isinstance(name, str) else name


declare(
    "to",
    "The output's format where OUT's name does not say it: safetensors (a folder of shards) or gguf (one file) "
    "(default: gguf for an OUT ending in .gguf or a --gguf-type, else safetensors).",
    parse=_lowered,
    metavar="FORMAT",
    after="dtype",
)  # checked here, where the sinks are known (``sink_for``): its values are the registry's names


def sink_for(options: "ConvertOptions") -> type["Sink"]:
    """The sink the options ask for (``to``, or the one that claims them), each sink's own options checked (a GGUF
    type without a GGUF output is refused)."""
    asked = options.to
    if asked is not None and asked not in SINKS.discovered():
        raise ArgumentError(f"to {asked!r} is not one of {', '.join(sorted(SINKS))}", option="to")
    chosen = None
    for sink in all_sinks():
        claimed = sink.claims(options) if asked is None else sink.name == asked
        if asked is not None and not claimed and not sink.default and sink.claims(options):
            raise ArgumentError(
                f"to={asked!r} asks for a {asked} output, but the output's name (or its own options) asks for "
                f"{sink.name}: give one or the other",
                option="to",
            )
        sink.check_options(options, claimed=claimed)
        if claimed and chosen is None:
            chosen = sink
    return chosen


class Delivery:
    """Where a run that keeps no local copy sends each large file of its output as soon as it is complete (a push
    straight to the Hub, ``hub/streamed_push.py``): a sink that supports it (``delivers``) makes its files a bounded
    number at a time, in order, and hands each over (``finished``, which may wait for room and removes the file); a
    file the destination holds already (``wanted`` False) is not made at all. What is left in the staging folder at
    the end (side files, a sink's one file) goes with the last step."""

    on_disk = 2  # the output's large files on local disk at once, the one being written included

    def wanted(self, name: str) -> bool:
        """Whether the file ``name`` (its path in the output) is to be made."""
        return True

    def finished(self, path: Path) -> None:
        """``path`` is complete: taken (it may wait until an earlier one is sent, and removes it)."""


@dataclass
class Written:
    """What a sink wrote."""

    tensors: int  # tensors in the output
    infinite: list[str] = field(default_factory=list)  # fp16 tensors written with ±inf (plan.may_exceed), in order
    warnings: list[str] = field(default_factory=list)  # what the writer said on the tensors, each once


class Sink:
    """One output format. Class methods answer before a plan exists; an instance (``for_plan``) is the sink of one
    conversion."""

    name: ClassVar[str]  # the registry's key ("safetensors", "gguf")
    default: ClassVar[bool] = False  # takes every output no other sink claims
    file: ClassVar[bool] = False  # the output is one file (else a folder)
    exact_size: ClassVar[bool] = True  # its size bound is the output's size (else an upper bound)
    own_type: str | None = None  # the output's own type beyond its tensors' dtype, where it has one (a GGUF type)
    delivers: ClassVar[bool] = False  # hands its large files to a ``Delivery`` one by one as they are complete

    @classmethod
    def claims(cls, options: "ConvertOptions") -> bool:
        """Whether these options ask for this output."""
        return cls.default

    @classmethod
    def check_options(cls, options: "ConvertOptions", *, claimed: bool) -> None:
        """ArgumentError for a value of an option this sink owns that is not valid, or that asks for this output
        where the rest of the options do not (``claimed`` False)."""

    @classmethod
    def adjusted(cls, options: "ConvertOptions") -> "ConvertOptions":
        """The options as this output makes its tensors (a GGUF's dense dtype)."""
        return options

    @classmethod
    def check_ready(cls) -> None:
        """DependencyError when a library this output needs is missing: said before anything is downloaded."""

    @classmethod
    def begin_imports(cls) -> None:
        """The libraries this output needs begun importing on the preload thread (``preload.py``), while the command
        resolves and plans; none by default."""

    @classmethod
    def batch_output(cls, output_root, stem: str, options: "ConvertOptions") -> str:
        """Where a batch writes ``stem``'s output, ``<dtype>`` standing for a dtype the plan will decide."""
        raise NotImplementedError

    def __init__(self, options: "ConvertOptions", plan: "Plan", name: str):
        """``name``: the model's name (a GGUF's converter reads it as the dense folder's)."""
        self.options, self.plan, self.model = options, plan, name

    @classmethod
    def for_plan(cls, options: "ConvertOptions", plan: "Plan", name: str) -> "Sink":
        return cls(options, plan, name)

    def default_output(self, output_dir, stem: str) -> Path:
        """The output's name when the user gives none: ``<output_dir or .>/<stem>-<what it is>``."""
        raise NotImplementedError

    def check_plan(self) -> None:
        """CheckpointError for what this output cannot hold of the plan, found before a weight is read."""

    def size_bound(self) -> int:
        """At most the bytes the output takes on disk (what its disk must hold)."""
        raise NotImplementedError

    def delivered_disk(self, on_disk: int) -> int:
        """At most the bytes on local disk at once when the output is delivered as it is made (``Delivery`` with
        ``on_disk`` files at once): the whole output where the sink does not deliver file by file."""
        return self.size_bound()

    def what(self, planned: bool = False) -> str:
        """What the output is, as a summary (``planned``: a dry run's plan) says it: "bfloat16", "GGUF q8_0 ..."."""
        raise NotImplementedError

    def label(self) -> str:
        """What the progress bar says is being made."""
        raise NotImplementedError

    def plan_lines(self) -> list[str]:
        """A dry run's lines on the output's layout."""
        return []

    def write(
        self,
        staging: Path,
        output: Path,
        reader: "TensorReader",
        route,
        *,
        card: Callable[[], str | None],
        settings: "Settings",
        progress: Callable[[int], None],
        tensor_done: Callable[[int], None],
        delivery: Delivery | None = None,
    ) -> Written:
        """Write the plan's output into the staging folder ``staging`` (as ``output``'s name where it is one file),
        the tensors made through ``route``; ``card()`` gives the model card's text (made meanwhile: asked for only
        when needed). ``delivery`` (given only to a sink that ``delivers``): each large file handed over as it is
        complete, those it does not want not made."""
        raise NotImplementedError

    def place(self, staging: Path, output: Path, *, overwrite: bool) -> int:
        """Move the finished output from ``staging`` into place at ``output``; its bytes (as a summary counts them)."""
        raise NotImplementedError

    def pushed_card(self, card: str, output: Path) -> str | None:
        """The model card a push uploads beside a one-file output (None: the output holds its own README.md)."""
        return None

    @classmethod
    def push(cls, output: Path, repo_id: str, *, card: str | None, private: bool, token, revision, progress) -> str:
        """Upload the finished output to ``repo_id``; the repo's URL."""
        raise NotImplementedError

    @classmethod
    def push_again(cls, output: Path, repo_id: str, *, card: str | None, private: bool, branch: str | None) -> str:
        """After a failed ``push``: the command that uploads what it would have (``card``: as ``push`` took it), with
        huggingface_hub's own CLI, keeping beside the output what that needs and the output lacks."""
        raise NotImplementedError
