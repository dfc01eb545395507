"""The options of a conversion and of a check, parsed once where they enter (the command line, the API's ``convert`` and
``verify``) into one frozen object that travels down: dtypes as ``DType``, sizes as bytes, paths as paths, the
environment's ``Settings`` read. Code beneath takes them as they are.

Each option is declared once, as an :class:`Option` beside its field (``option(...)``): its flag, help, choices,
default, how a given value is parsed and checked, and the hint an error about it gets. The command line's options
(``cli/flags.py``), the API's keywords and their checking (``parse``) and the command line's hints are made from
these declarations. An option that belongs to one module beyond this one (a sink's: ``gguf_type``) is declared there,
with ``declare``; it travels on ``ConvertOptions`` as its other options do (``options.gguf_type``), and that module
checks its values.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

from .dtypes import OUTPUT_CHOICES, DType, output_dtype
from .errors import ArgumentError
from .paths import expanded, expanded_output
from .refs import ref_problem
from .settings import Settings
from .sizes import DEFAULT_SHARD_SIZE, parse_size
from .strict_json import shown

OPTION = "nf4convert.option"  # the key of a field's metadata that holds its Option


@dataclass(frozen=True)
class Option:
    """One option, as the command line and the API take it."""

    help: str
    default: object = None  # as the user would give it (the API keyword's default; ``--help`` shows it where asked)
    parse: Callable[[object], object] | None = None  # a given value (not None) -> the field's; ArgumentError if bad
    choices: tuple[str, ...] | None = None  # the values the command line takes, in any case
    switch: bool = False  # a flag that takes no value
    flags: tuple[str, ...] | None = None  # the command line's spellings (None: --<name, '_' as '-'>; (): the API's)
    metavar: str | None = None
    folder: bool = False  # its value names a folder
    file: bool = False  # its value names a file
    envvar: str | None = None  # the environment variable the command line reads where the flag is not given
    show_default: bool = False
    once: bool = False  # given twice on the command line is refused (else the last would win, the first dropped)
    hint: str | None = None  # what an error naming this option adds on the command line (default: "see --flag")
    after: str | None = None  # a module's own option: shown in ``--help`` after this one
    helps: tuple[tuple[str, str], ...] = ()  # (command, its help) where a command says it otherwise (batch: no OUT)
    name: str = ""  # the API keyword and the field's name: set where it is declared

    @property
    def flag(self) -> str | None:
        """The command line's long spelling (None: the option is the API's alone)."""
        flags = self.flags if self.flags is not None else (f"--{self.name.replace('_', '-')}",)
        return max(flags, key=len) if flags else None

    @property
    def spellings(self) -> tuple[str, ...]:
        return self.flags if self.flags is not None else (f"--{self.name.replace('_', '-')}",)

    @property
    def error_hint(self) -> str | None:
        """What an error that names this option says on the command line after its text."""
        if self.hint is not None or self.flag is None:
            return self.hint
        return f"see {self.flag}"

    def help_of(self, command: str) -> str:
        """What ``command --help`` says of this option."""
        return dict(self.helps).get(command, self.help)

    def parsed(self, value):
        """``value`` as given -> the field's value (None stays None, but for a switch: off)."""
        if self.switch:
            return bool(value)
        return self.parse(value) if value is not None and self.parse is not None else value


def option(help: str, **declared) -> dataclasses.Field:
    """A field declared as an option (``Option``'s arguments); its default is the parsed default."""
    spec = Option(help, **declared)
    return field(default=spec.parsed(spec.default), metadata={OPTION: spec})


DECLARED: dict[str, Option] = {}  # the options other modules declare (``declare``), by name, in declaration order
# What imports the modules that declare options, each called before the declared options are looked at (the sinks'
# registry adds its discovery as it is imported): a module above this one, found without this one importing it.
DISCOVERIES: list[Callable[[], object]] = []


def declare(name: str, help: str, **declared) -> Option:
    """Declare a conversion option of another module (a sink's), where that module is defined: it is then a flag of
    ``convert`` and ``batch``, a keyword of the API's ``convert`` and an attribute of ``ConvertOptions``."""
    spec = Option(help, name=name, **declared)
    known = DECLARED.get(name)
    again = known is not None and (known.help, known.after) == (spec.help, spec.after)  # its module imported again
    if (known is not None and not again) or name in {f.name for f in dataclasses.fields(ConvertOptions)}:
        raise ValueError(f"option {name!r} is declared twice")
    DECLARED[name] = spec
    return spec


def declared_fields(cls, *, nested: bool = True) -> list[Option]:
    """The options of ``cls``'s fields in their order, named (``nested``: a field that holds options of its own, as
    ``hub``, gives its options in its place)."""
    found = []
    for spec in dataclasses.fields(cls):
        if OPTION in spec.metadata:
            found.append(dataclasses.replace(spec.metadata[OPTION], name=spec.name))
        elif nested and "options" in spec.metadata:
            found += declared_fields(spec.metadata["options"])
    return found


def conversion_options() -> list[Option]:
    """A conversion's options in ``--help`` order: its fields', each declared option after the one it names."""
    for discover in DISCOVERIES:
        discover()
    ordered = declared_fields(ConvertOptions)
    for spec in DECLARED.values():
        names = [known.name for known in ordered]
        at = names.index(spec.after) + 1 if spec.after in names else len(ordered)
        while at < len(ordered) and ordered[at].after == spec.after and ordered[at].name in DECLARED:
            at += 1  # after the ones placed there before it
        ordered.insert(at, spec)
    return ordered


def every_option() -> dict[str, Option]:
    """Every option by name (a conversion's first where verify's has the same name): what an error's hint is made
    from."""
    found = {}
    for spec in [*conversion_options(), *declared_fields(VerifyOptions)]:
        found.setdefault(spec.name, spec)
    return found


def keyword_signature(function, declared: list[Option]) -> inspect.Signature:
    """``function``'s signature with its ``**options`` spelled out as the keywords ``declared`` gives, each with its
    default: what ``help()`` and an editor show of the API's ``convert`` and ``verify``."""
    signature = inspect.signature(function)
    params = [param for param in signature.parameters.values() if param.kind is not inspect.Parameter.VAR_KEYWORD]
    taken = {param.name for param in params}
    params += [
        inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=spec.default)
        for spec in declared
        if spec.name not in taken
    ]
    return signature.replace(parameters=params)


def _revision(revision):
    """A revision must be a branch, tag or commit name (refs.py), as a push's branch."""
    problem = ref_problem(revision)
    if problem is not None:
        raise ArgumentError(f"revision {shown(revision)}: {problem}", option="revision")
    return revision


def _dtype(dtype):
    return dtype if isinstance(dtype, DType) else output_dtype(dtype)


@dataclass(frozen=True)
class HubOptions:
    """Where a Hub SOURCE (and ADAPTER) is read from."""

    revision: str | None = option(
        "Hub branch, tag or commit of SOURCE (default: main; not for a local folder).", parse=_revision
    )  # of SOURCE only (a local folder has none)
    token: str | None = option(
        "Hub token for private or gated repos (default: $HF_TOKEN).",
        envvar="HF_TOKEN",
        hint="pass --token or set HF_TOKEN",
    )
    cache_dir: Path | None = option("Hub cache folder (default: $HF_HUB_CACHE).", parse=Path, folder=True)
    download: bool = option(
        "Download a Hub SOURCE's weights into the Hub cache first and read them there. By default they are streamed as "
        "they are read: no copy on disk, the download overlapped with the work. Pick --download to read the same repo "
        "again later (or offline); weights already in the cache are read there either way, and every byte is checked "
        "against the Hub's hash in both.",
        default=False,
        switch=True,
    )  # the weights downloaded into the Hub cache first, not streamed


def _hub() -> dataclasses.Field:
    """The field that holds the Hub options: their flags are the command's, their keywords the API's."""
    return field(default_factory=HubOptions, metadata={"options": HubOptions})


@dataclass(frozen=True)
class ConvertOptions:
    """How one conversion is made and where it goes (``convert``'s parameters, parsed); the options other modules
    declare (``declare``) are its attributes too."""

    hub: HubOptions = _hub()
    adapter: str | None = option(
        "A peft LoRA adapter (folder or Hub repo id) to merge into the weights, bit for bit as peft merges.",
        parse=os.fspath,
        once=True,
    )  # as the user named it
    # of every floating output tensor; None: auto (the dtype the model was quantized from)
    dtype: DType | None = option(
        "Output dtype; auto keeps the dtype the model was quantized from.",
        default="auto",
        parse=_dtype,
        choices=OUTPUT_CHOICES,
        show_default=True,
    )
    device: str = option(
        "auto, cpu, cuda or cuda:N (auto: the GPU if there is one).", default="auto", show_default=True
    )  # checked when the device is picked (devices.pick_device): that needs torch
    max_shard_size: int = option(
        "Largest output shard, like transformers': a number of bytes, or of KB, MB, GB, TB (powers of 1000) or KiB, "
        "MiB, GiB, TiB (powers of 1024).",
        default=DEFAULT_SHARD_SIZE,
        parse=parse_size,
        show_default=True,
    )
    overwrite: bool = option(
        "Replace OUT if it exists (only once the new output is complete).",
        helps=(
            (
                "batch",
                "Replace a source's output in OUTPUT_ROOT if it exists (only once the new one is complete); the rest "
                "of OUTPUT_ROOT stays as it is.",
            ),
        ),
        default=False,
        switch=True,
        hint="pass --overwrite to replace it",
    )
    allow_no_config: bool = option(
        "Convert a SOURCE that has no config.json (refused otherwise): the output holds the dense tensors without one, "
        "so transformers cannot load it as a model by itself.",
        default=False,
        switch=True,
        hint="or pass --allow-no-config to write the dense tensors alone",
    )
    allow_non_finite: bool = option(
        "Keep the NaN or ±inf values an adapter's merge makes where the base has none (refused otherwise: such a "
        "model is broken); a warning names the tensors.",
        default=False,
        switch=True,
        hint="--allow-non-finite writes them anyway",
    )  # keep the NaN or ±inf values an adapter merge makes (refused otherwise)
    progress: bool = option("Progress bars.", default=True, switch=True, flags=())  # the command line's -q
    # OUT as given (None: named for the user, in output_dir or here): the command line's -o
    output: Path | None = option("The output.", parse=lambda name: expanded_output(name, "output"), flags=())
    output_dir: Path | None = option(
        "Where a named output goes.", parse=lambda name: expanded(name, "output_dir"), flags=()
    )
    stem: str | None = option("The default output's name before its suffix.", flags=())
    settings: Settings = field(default_factory=Settings)  # the environment's NF4CONVERT_* variables, read
    owned: dict = field(default_factory=dict)  # the declared options' values (``declare``), by name

    parse_function: ClassVar[str] = "convert"

    @classmethod
    def parse(cls, *, settings: Settings | None = None, **given) -> "ConvertOptions":
        """The options as ``convert`` takes them, checked once: ArgumentError naming the first bad one, TypeError for
        a keyword it does not take; ``settings`` (default: read from the environment)."""
        output, output_dir, stem = (given.get(name) for name in ("output", "output_dir", "stem"))
        if output is not None and (output_dir is not None or stem is not None):
            named = "output_dir" if output_dir is not None else "stem"
            raise ArgumentError(
                f"output and {named} both given: output names the folder itself, output_dir and stem name "
                "it for you; give one or the other",
                option=named,
            )
        if stem is not None and not plain_name(stem):
            raise ArgumentError(f"stem {stem!r} is not a plain folder name (no '/', not '.' or '..')", option="stem")
        values = _parsed(conversion_options(), given, cls.parse_function)
        hub = HubOptions(**{name: values.pop(name) for name in [spec.name for spec in declared_fields(HubOptions)]})
        owned = {name: values.pop(name) for name in DECLARED}
        return cls(hub=hub, **values, settings=Settings.from_env() if settings is None else settings, owned=owned)

    def __getattr__(self, name: str):
        """A declared option's value (``declare``)."""
        if name != "owned" and not name.startswith("__") and name not in DECLARED:
            conversion_options()  # the modules that declare options imported
        if name != "owned" and name in DECLARED:
            owned = self.__dict__.get("owned", {})
            return owned[name] if name in owned else DECLARED[name].parsed(DECLARED[name].default)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def replace(self, **changes) -> "ConvertOptions":
        """These options with ``changes`` (already parsed values)."""
        owned = {name: changes.pop(name) for name in list(changes) if name in DECLARED}
        return dataclasses.replace(self, **changes, owned={**self.owned, **owned})


@dataclass(frozen=True)
class VerifyOptions:
    """How an output is checked against its source (``verify``'s parameters, parsed)."""

    device: str = option(
        "Where the reference libraries recompute: auto, cpu, cuda, cuda:N.", default="auto", show_default=True
    )
    adapter: str | None = option(
        "The LoRA adapter that was merged (peft merges it again for the check).", parse=os.fspath, once=True
    )  # the adapter that was merged, as the user named it
    # a GGUF's: the dtype its tensors were made in (None: as a conversion chooses)
    dtype: DType | None = option(
        "For a GGUF OUTPUT: the --dtype it was converted with (its tensors' dtype before the GGUF type). A folder's "
        "tensors say their own: another dtype is refused.",
        default="auto",
        parse=_dtype,
        choices=OUTPUT_CHOICES,
        show_default=True,
    )
    progress: bool = option("Progress bars.", default=False, switch=True, flags=())  # the command line's -q
    hub: HubOptions = _hub()
    settings: Settings = field(default_factory=Settings)  # the environment's NF4CONVERT_* variables, read

    parse_function: ClassVar[str] = "verify"

    @classmethod
    def parse(cls, *, settings: Settings | None = None, **given) -> "VerifyOptions":
        """The options as ``verify`` takes them, checked once."""
        values = _parsed(declared_fields(cls), given, cls.parse_function)
        hub = HubOptions(**{name: values.pop(name) for name in [spec.name for spec in declared_fields(HubOptions)]})
        return cls(hub=hub, **values, settings=Settings.from_env() if settings is None else settings)

    @classmethod
    def of(cls, options: ConvertOptions, dtype: DType | None = None) -> "VerifyOptions":
        """The options that check what ``options`` converted (``dtype``: the dtype it was made in)."""
        return cls(options.device, options.adapter, dtype, options.progress, options.hub, options.settings)


def _parsed(declared: list[Option], given: dict, function: str) -> dict:
    """Each declared option's value, parsed from ``given`` (its default where not given), in their order; TypeError
    for a keyword none declares, as Python words it."""
    names = {spec.name for spec in declared}
    unknown = next((name for name in given if name not in names), None)
    if unknown is not None:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown!r}")
    return {spec.name: spec.parsed(given.get(spec.name, spec.default)) for spec in declared}


def plain_name(stem: str) -> bool:
    """Whether ``stem`` names one folder: no '/', not '.' or '..'."""
    return isinstance(stem, str) and stem not in ("", ".", "..") and Path(stem).name == stem
