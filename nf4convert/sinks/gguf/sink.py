"""The GGUF sink: one ``.gguf`` file, written by llama.cpp's converter (``gguf_converter.py``) from the plan's tensors.

No dense checkpoint is written: the converter's lazy tensors take our tensors from a feed (``gguf_feed.py``) that makes
them through the pipeline ahead of the writer, and where a tensor's graph allows, a fast path (``gguf_fast.py``) writes
the same bytes as the converter's graph without its fp32 round trip. The converter still decides everything else:
names, types, shapes, order, metadata, the tokenizer.

Which GGUF type: ``--gguf-type``, or the dense dtype's own float type (bf16 -> bf16, fp16 -> f16, fp32 -> f32); with
``--dtype auto`` a float ``--gguf-type`` makes the dense tensors in that type, so they need no conversion.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ...settings import Settings
from ..naming import default_output
from .converter import (
    FLOAT_TYPES,
    check,
    converter,
    converter_errors,
    converter_model,
    converter_order,
    quiet_converter,
    staged,
    tensors_of,
)
from .fast import FastTensor, recognise
from .feed import Feed
from .q8_0 import Q8_0
from .writes import PositionalWrites

GGUF_SUFFIX = ".gguf"


def is_gguf(output) -> bool:
    """Whether an output path names a GGUF file (rather than a folder)."""
    return output is not None and str(output).lower().endswith(GGUF_SUFFIX)


def written_type(gguf_type: str | None, dtype) -> str:
    """The GGUF type written: ``gguf_type``, or the float type of ``dtype`` (the plan's ``dtypes.DType``)."""
    return gguf_type or FLOAT_TYPES[dtype.short]


@dataclass(frozen=True)
class GgufTarget:
    """What a GGUF output is: its GGUF type, and the model's name the converter reads (from the dense folder's)."""

    type: str
    name: str


def default_gguf_output(output_dir, stem: str, gguf_type: str) -> Path:
    """The default GGUF output: ``<output_dir or .>/<stem>-<type>.gguf``."""
    return default_output(output_dir, stem, f"{gguf_type}{GGUF_SUFFIX}")


def size_bound(plan, gguf_type: str) -> int:
    """At most the bytes of the GGUF of ``plan``: each tensor at the type's size (one-dimensional ones in fp32, as the
    converter writes them), padding, and the side files' bytes again for the metadata (the vocabulary)."""
    per_value = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32}[gguf_type]
    values = sum(math.prod(tensor.shape) * (4 if len(tensor.shape) <= 1 else per_value) for tensor in plan.tensors)
    return int(values) + 32 * len(plan.tensors) + plan.side_bytes + (1 << 20)


def pushed_card(card: str, file_name: str, gguf_type: str) -> str:
    """The model card pushed beside a GGUF: the dense card (the one the converter read the metadata from), with a
    section on the file first."""
    from .converter import CONVERTER, CONVERTER_VERSION

    section = (
        f"## GGUF\n\n`{file_name}` is a GGUF file of type {gguf_type}, written in one pass by nf4convert with "
        f"llama.cpp's converter ({CONVERTER} {CONVERTER_VERSION}): the file `convert_hf_to_gguf.py --outtype "
        f"{gguf_type}` writes from the dense weights this card describes, byte for byte, without a dense copy written "
        "in between."
    )
    closing = card.find("\n---\n", 3) if card.startswith("---\n") else -1
    if closing != -1:
        end = closing + len("\n---\n")
        return f"{card[:end]}\n{section}\n\n{card[end:].lstrip(chr(10))}"
    return f"{section}\n\n{card}"


def check_convertible(plan, gguf_type: str, name: str, card: str | None = None) -> None:
    """CheckpointError for what llama.cpp's converter refuses of this plan (architecture, tensor names, config fields,
    tokenizer), found without reading a weight (``gguf_converter.check``); DependencyError without the converter."""
    with staged(plan.folder, plan.config or {}, card, name) as stage:
        check(stage, tensors_of(plan), gguf_type, plan.folder)


@dataclass
class GgufWritten:
    tensors: int = 0  # tensors in the GGUF
    fast: int = 0  # of which a fast path wrote
    infinite: list[str] = field(default_factory=list)  # fp16 tensors made with ±inf (plan.may_exceed)
    warnings: list[str] = field(default_factory=list)  # the converter's on the tensors, each once


def write_gguf(
    plan,
    path: Path,
    reader,
    route,
    *,
    gguf_type: str,
    name: str,
    card: str | None,
    settings: Settings | None = None,
    progress: Callable[[int], None] = lambda nbytes: None,
    fast: bool = True,
) -> GgufWritten:
    """Write the GGUF that llama.cpp's converter makes from the dense checkpoint of ``plan`` into ``path``, reading the
    source through ``reader`` and making tensors on ``route``. ``name``: the model's name, as the converter would read
    it from the dense folder's name; ``card``: the dense model card. ``progress(bytes)`` as dense tensors are made.
    ``fast``: take the fast paths (off: the converter's own graph for every tensor).

    Raises:
        DependencyError: the converter (the "gguf" extra) is missing or not the pinned one.
        CheckpointError: the converter cannot convert the model (architecture, tokenizer, config).
    """
    import numpy as np
    import torch

    settings = settings or Settings()
    gguf, _ = converter()
    written = GgufWritten()
    feed = Feed(plan, reader, route, writers=settings.writers, progress=progress)
    writes: list[PositionalWrites] = []  # the file's, once the converter's writer has opened it

    def is_source(node):
        function = node._func
        return node._args[0] if getattr(function, "__self__", None) is feed else None

    def edge_blocks(blocks):
        with np.errstate(all="ignore"):  # NaN and overflow are what these blocks hold: gguf-py's answer, unsaid
            return gguf.quants.Q8_0.quantize_blocks(blocks)

    quantizer = functools.cache(lambda: Q8_0(route.device, edge_blocks))  # one set of buffers for every tensor

    def install(writer) -> None:
        """Every written tensor taken by a fast path where one gives its bytes; the feed started in writing order."""
        order = []
        for split in writer.tensors:
            for info in split.values():
                recognised = recognise(info.tensor, is_source, gguf) if fast else None
                if recognised is not None:
                    device = route.device if recognised.kind == "q8_0" else "cpu"  # nothing to compute for the rest
                    info.tensor = FastTensor(recognised, info.nbytes, feed.take, device, quantizer, lambda: writes[0])
                    order.append(recognised.source)
                    written.fast += 1
                else:
                    order += _sources(info.tensor, is_source)
                written.tensors += 1
        feed.expect(order)

    feed.start([name for name, *_ in converter_order(tensors_of(plan))])  # while the converter sets up
    try:
        with (
            staged(plan.folder, plan.config or {}, card, name) as stage,
            converter_errors(plan.folder),
            quiet_converter(),
            torch.inference_mode(),
        ):
            model = converter_model(stage, tensors_of(plan), feed.take, Path(path), gguf_type)
            prepare_tensors, writer = model.prepare_tensors, model.gguf_writer
            write_tensors = writer.write_tensors_to_file

            def prepared():
                with quiet_converter(written.warnings):  # its words on the tensors (a type it falls back from)
                    prepare_tensors()
                install(writer)

            def write_tensors_in_place(progress=False):
                writes.append(PositionalWrites(writer.fout[0].fileno(), writeback=settings.writeback))
                try:
                    write_tensors(progress=False)  # our bar, not its
                    writes[0].finish()
                finally:
                    writes[0].close()

            model.prepare_tensors = prepared
            writer.write_tensors_to_file = write_tensors_in_place
            model.write()
    finally:
        feed.close()
    written.infinite = feed.infinite
    return written


def _sources(lazy, is_source) -> list[str]:
    """The names of our tensors a lazy graph reads, depth first."""
    from gguf.lazy import LazyBase

    found, stack = [], [lazy]
    while stack:
        node = stack.pop()
        if isinstance(node, (list, tuple)):
            stack += reversed(node)
        elif isinstance(node, LazyBase):
            name = is_source(node)
            if name is not None:
                found.append(name)
            else:
                stack += reversed([*node._args, *node._kwargs.values()])
    return found
