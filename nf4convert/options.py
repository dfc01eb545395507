"""The options of a conversion, parsed once where they enter (the command line, the API's ``convert``) into one frozen
object that travels down: dtypes as ``DType``, sizes as bytes, paths as paths. Code beneath takes them as they are.

An option that belongs to one output (``gguf_type``) is checked by that output's sink (``sinks/``), which owns its
values; everything else is checked here, each option once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from .dtypes import DType, output_dtype
from .errors import ArgumentError
from .paths import expanded, expanded_output
from .refs import ref_problem
from .sizes import DEFAULT_SHARD_BYTES, DEFAULT_SHARD_SIZE, parse_size
from .strict_json import shown


@dataclass(frozen=True)
class HubOptions:
    """Where a Hub SOURCE (and ADAPTER) is read from."""

    revision: str | None = None  # of SOURCE only (a local folder has none)
    token: str | None = None
    cache_dir: Path | None = None
    download: bool = False  # the weights downloaded into the Hub cache first, not streamed

    @classmethod
    def parse(cls, revision=None, token=None, cache_dir=None, download=False) -> "HubOptions":
        """The Hub options, checked: a revision must be a branch, tag or commit name (refs.py), as a push's branch."""
        problem = ref_problem(revision) if revision is not None else None
        if problem is not None:
            raise ArgumentError(f"revision {shown(revision)}: {problem}", option="revision")
        return cls(revision, token, Path(cache_dir) if cache_dir is not None else None, bool(download))


@dataclass(frozen=True)
class ConvertOptions:
    """How one conversion is made and where it goes (``convert``'s parameters, parsed)."""

    dtype: DType | None = None  # of every floating output tensor; None: auto (the dtype the model was quantized from)
    adapter: str | None = None  # a peft LoRA adapter to merge, as the user named it
    hub: HubOptions = field(default_factory=HubOptions)
    device: str = "auto"  # checked when the device is picked (devices.pick_device): that needs torch
    max_shard_size: int = DEFAULT_SHARD_BYTES
    overwrite: bool = False
    allow_no_config: bool = False
    allow_non_finite: bool = False  # keep the NaN or ±inf values an adapter merge makes (refused otherwise)
    gguf_type: str | None = None  # checked by the GGUF sink, whose values they are
    imatrix: str | None = None  # llama-quantize's importance matrix, as the user named it (the GGUF sink's)
    progress: bool = True
    output: Path | None = None  # OUT as given (None: named for the user, in output_dir or here)
    output_dir: Path | None = None
    stem: str | None = None  # the default output's name before its suffix

    @classmethod
    def parse(
        cls,
        *,
        output=None,
        dtype="auto",
        adapter=None,
        revision=None,
        token=None,
        cache_dir=None,
        download=False,
        device="auto",
        max_shard_size=DEFAULT_SHARD_SIZE,
        overwrite=False,
        allow_no_config=False,
        allow_non_finite=False,
        gguf_type=None,
        imatrix=None,
        progress=True,
        output_dir=None,
        stem=None,
    ) -> "ConvertOptions":
        """The options as ``convert`` takes them, checked once: ArgumentError naming the first bad one."""
        if output is not None and (output_dir is not None or stem is not None):
            given = "output_dir" if output_dir is not None else "stem"
            raise ArgumentError(
                f"output and {given} both given: output names the folder itself, output_dir and stem name "
                "it for you; give one or the other",
                option=given,
            )
        if stem is not None and not plain_name(stem):
            raise ArgumentError(f"stem {stem!r} is not a plain folder name (no '/', not '.' or '..')", option="stem")
        return cls(
            dtype=dtype if isinstance(dtype, DType) else output_dtype(dtype),
            adapter=os.fspath(adapter) if adapter is not None else None,
            hub=HubOptions.parse(revision, token, cache_dir, download),
            device=device,
            max_shard_size=parse_size(max_shard_size),
            overwrite=bool(overwrite),
            allow_no_config=bool(allow_no_config),
            allow_non_finite=bool(allow_non_finite),
            gguf_type=gguf_type.lower() if isinstance(gguf_type, str) else gguf_type,
            imatrix=os.fspath(imatrix) if imatrix is not None else None,
            progress=bool(progress),
            output=expanded_output(output, "output") if output is not None else None,
            output_dir=expanded(output_dir, "output_dir") if output_dir is not None else None,
            stem=stem,
        )

    def replace(self, **changes) -> "ConvertOptions":
        """These options with ``changes`` (already parsed values)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class VerifyOptions:
    """How an output is checked against its source (``verify``'s parameters, parsed)."""

    device: str = "auto"
    adapter: str | None = None  # the adapter that was merged, as the user named it
    hub: HubOptions = field(default_factory=HubOptions)
    progress: bool = False
    dtype: DType | None = None  # a GGUF's: the dtype its tensors were made in (None: as a conversion chooses)

    @classmethod
    def parse(
        cls,
        *,
        device="auto",
        adapter=None,
        revision=None,
        token=None,
        cache_dir=None,
        download=False,
        progress=False,
        dtype="auto",
    ) -> "VerifyOptions":
        """The options as ``verify`` takes them, checked once."""
        return cls(
            device=device,
            adapter=os.fspath(adapter) if adapter is not None else None,
            hub=HubOptions.parse(revision, token, cache_dir, download),
            progress=bool(progress),
            dtype=dtype if isinstance(dtype, DType) or dtype is None else output_dtype(dtype),
        )

    @classmethod
    def of(cls, options: ConvertOptions, dtype: DType | None = None) -> "VerifyOptions":
        """The options that check what ``options`` converted (``dtype``: the dtype it was made in)."""
        return cls(options.device, options.adapter, options.hub, options.progress, dtype)


def plain_name(stem: str) -> bool:
    """Whether ``stem`` names one folder: no '/', not '.' or '..'."""
    return isinstance(stem, str) and stem not in ("", ".", "..") and Path(stem).name == stem
