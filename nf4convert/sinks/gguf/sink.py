"""The GGUF sink: one ``.gguf`` file, written by llama.cpp's converter (``converter.py``) from the plan's tensors.

No dense checkpoint is written. Once the converter has prepared its tensors, the file's layout is known but for where
the data begins; a feed (``feed.py``) then makes them through the pipeline in the file's order while the converter
writes the metadata. Where a tensor's graph allows, a fast path (``fast.py``) gives the same bytes as the converter's
graph without its fp32 round trip: written piece by piece at their places by the pipeline's writers where the
converter's layout steps keep the values' order (``streamed.py``; the embedding and the head are never whole), else
from the tensor made whole. The converter still decides everything else: names, types, shapes, order, metadata, the
tokenizer.

Which GGUF type: ``--gguf-type``, or the dense dtype's own float type (bf16 -> bf16, fp16 -> f16, fp32 -> f32); with
``--dtype auto`` a float ``--gguf-type`` makes the dense tensors in that type, so they need no conversion.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ... import profile
from ...dtypes import DTYPES
from ...errors import ArgumentError, InternalError
from ...options import declare
from ...settings import Settings
from ...sizes import DEFAULT_SHARD_BYTES
from .. import output as lifecycle
from ..base import Sink, Written, register
from ..naming import default_output
from .converter import (
    FLOAT_TYPES,
    GGUF_TYPES,
    Vocabulary,
    check,
    converter,
    converter_errors,
    converter_model,
    dense_dtype,
    installed,
    passing,
    quiet_converter,
    staged,
    start_importing,
    tensors_of,
)
from .fast import FastTensor, recognise
from .feed import Feed
from .metadata import write_kv_data_to_file
from .q8_0 import Q8_0
from .streamed import GgufFileWrites, Layout, StreamedTensor
from .writes import PositionalWrites

GGUF_SUFFIX = ".gguf"


@dataclass
class GgufWritten(Written):
    fast: int = 0  # of the tensors, those a fast path wrote


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
    vocabulary: Vocabulary | None = None,
) -> GgufWritten:
    """Write the GGUF that llama.cpp's converter makes from the dense checkpoint of ``plan`` into ``path``, reading the
    source through ``reader`` and making tensors on ``route``. ``name``: the model's name, as the converter would read
    it from the dense folder's name; ``card``: the dense model card. ``progress(bytes)`` as dense tensors are made.
    ``fast``: take the fast paths (off: the converter's own graph for every tensor). ``vocabulary``: the one the
    check of the same staged folder recorded (``converter.check``), written instead of reading the tokenizer again.

    The converter runs as its ``write()`` runs, with two of its steps taken over: once its tensors are prepared (their
    lazy graphs, types and sizes: the file's layout but for where the data begins), the feed starts making them in the
    file's order, streamed tensors' pieces waiting for the layout while the converter writes the metadata (the
    tokenizer's vocabulary, the card's fields); then the tensors' bytes are written at their places, the tensors made
    whole converted on this thread (``_write_tensors``).

    Raises:
        DependencyError: the converter (the "gguf" extra) is missing or not the pinned one.
        CheckpointError: the converter cannot convert the model (architecture, tokenizer, config).
    """
    import numpy as np
    import torch

    from ...devices import cpu_cores
    from ...safetensors_io.write import Writeback

    settings = settings or Settings()
    gguf, _ = converter()
    written = GgufWritten(0)
    writers = settings.writers
    if gguf_type == "q8_0" and not route.gpu:  # the writing threads quantize: the CPU's cores are the work's
        writers = max(writers, cpu_cores() // 2)
    feed = Feed(plan, reader, route, writers=writers, progress=progress)
    layout = Layout()
    dtypes = {tensor.name: DTYPES[tensor.dtype].torch for tensor in plan.tensors}

    def is_source(node):
        function = node._func
        return node._args[0] if getattr(function, "__self__", None) is feed else None

    def edge_blocks(blocks):
        with np.errstate(all="ignore"):  # NaN and overflow are what these blocks hold: gguf-py's answer, unsaid
            return gguf.quants.Q8_0.quantize_blocks(blocks)

    quantizer = functools.cache(lambda: Q8_0(route.device, edge_blocks))  # one set of buffers for every tensor
    writeback = Writeback() if settings.writeback else None
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    pieces = GgufFileWrites(descriptor, layout, route.device, edge_blocks, writeback)
    writes = PositionalWrites(descriptor, writeback=settings.writeback)
    streamed: list[StreamedTensor] = []

    def install(writer) -> None:
        """Every written tensor taken by a fast path where one gives its bytes (streamed where its values keep their
        order), and the feed started in writing order."""
        order = []
        for split in writer.tensors:
            for tensor_name, info in split.items():
                recognised = recognise(info.tensor, is_source, gguf) if fast else None
                if recognised is None:
                    order += _sources(info.tensor, is_source)
                    written.tensors += 1
                    continue
                stream = None
                if recognised.streamed:
                    source = recognised.source
                    stream = StreamedTensor(tensor_name, recognised.kind, dtypes[source], info.nbytes, pieces)
                    streamed.append(stream)
                    order.append((source, stream))
                else:
                    order.append(recognised.source)
                device = route.device if recognised.kind == "q8_0" else "cpu"  # nothing to compute for the rest
                info.tensor = FastTensor(
                    recognised, info.nbytes, feed.take, device, quantizer, lambda: writes, stream=stream
                )
                written.fast += 1
                written.tensors += 1
        feed.start(order)

    try:
        with (
            staged(plan.folder, plan.config or {}, card, name) as stage,
            converter_errors(plan.folder),
            quiet_converter(),
            torch.inference_mode(),
        ):
            model = converter_model(stage, tensors_of(plan), feed.take, Path(path), gguf_type)
            if vocabulary is not None:
                vocabulary.write_into(model)
            prepare_tensors, writer = model.prepare_tensors, model.gguf_writer

            @passing
            def prepared():
                with quiet_converter(written.warnings):  # its words on the tensors (a type it falls back from)
                    prepare_tensors()
                install(writer)
                profile.mark("GGUF tensors prepared")

            def write_tensors_in_place(progress=False):  # our bar, not its
                _write_tensors(writer, gguf, pieces, descriptor, writes)
                writes.finish()
                feed.finish()
                if not all(stream.complete() for stream in streamed):
                    raise InternalError(f"{path}: a Q8_0 block was left without all its values")

            model.prepare_tensors = prepared
            writer.write_kv_data_to_file = functools.partial(write_kv_data_to_file, writer)
            writer.write_tensors_to_file = write_tensors_in_place
            model.write()
    except BaseException:
        layout.fail()  # the pieces waiting for it stop at once
        raise
    finally:
        feed.close()
        writes.close()
        pieces.close()
        os.close(descriptor)
        if writeback is not None:
            writeback.close()
    written.infinite = feed.infinite
    return written


class _At:
    """A place in the file, for the writer of one tensor (``FastTensor.tofile``: ``tell``, ``seek``)."""

    def __init__(self, position: int):
        self.position = position

    def tell(self) -> int:
        return self.position

    def seek(self, position: int) -> None:
        self.position = position


def _write_tensors(writer, gguf, pieces: GgufFileWrites, descriptor: int, writes: PositionalWrites) -> None:
    """In place of gguf-py's ``write_tensors_to_file``: the tensor infos written and the data's place known (the
    streamed pieces held meanwhile written, those waiting for it going on), then each tensor made whole converted and
    handed to the positional writes at its place; the padding between tensors and after the last is a hole of zeros,
    as gguf-py writes it."""
    import numpy as np

    writer.write_ti_data_to_file()
    (out,) = writer.fout  # the converter writes one file here: a split would need its own layout
    writer.write_padding(out, out.tell())
    out.flush()
    offsets, position = {}, out.tell()
    for split in writer.tensors:
        for tensor_name, info in split.items():
            offsets[tensor_name] = position
            position += writer.ggml_pad(info.nbytes, writer.data_alignment)
    os.ftruncate(descriptor, position)
    for at, data in pieces.layout.set(offsets):
        pieces.pwrite(data, at)
    profile.mark("GGUF layout written")
    for split in writer.tensors:
        for tensor_name, info in split.items():
            tensor, info.tensor = info.tensor, None  # its graph and what it holds go once written
            if isinstance(tensor, FastTensor):
                tensor.tofile(_At(offsets[tensor_name]))
                continue
            made = gguf.LazyNumpyTensor.to_eager(tensor) if isinstance(tensor, gguf.LazyBase) else tensor
            made = np.ascontiguousarray(made)
            if made.nbytes != info.nbytes:
                raise InternalError(f"{tensor_name}: {made.nbytes} bytes made for a GGUF tensor of {info.nbytes}")
            writes.put(offsets[tensor_name], made.reshape(-1).view(np.uint8))
    writer.state = type(writer.state).WEIGHTS


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


def _lowered(gguf_type):
    return gguf_type.lower() if isinstance(gguf_type, str) else gguf_type


declare(
    "gguf_type",
    "Write one GGUF file of this type, as llama.cpp's converter writes it from the dense output (default with a .gguf "
    "OUT: the --dtype's own float type).",
    parse=_lowered,
    choices=tuple(GGUF_TYPES),
    after="dtype",
)  # its values checked by the sink (``check_options``)


@register
class GgufFile(Sink):
    """One GGUF file, as llama.cpp's converter writes it from the dense output: an OUT ending in ``.gguf``, or a
    ``gguf_type`` with no OUT (then named ``<stem>-<type>.gguf``)."""

    name = "gguf"
    file = True
    exact_size = False

    @classmethod
    def claims(cls, options) -> bool:
        named = options.output is not None and str(options.output).lower().endswith(GGUF_SUFFIX)
        return named or (options.output is None and options.gguf_type is not None)

    @classmethod
    def check_options(cls, options, *, claimed: bool) -> None:
        gguf_type = options.gguf_type
        if gguf_type is not None and gguf_type not in GGUF_TYPES:
            raise ArgumentError(f"GGUF type {gguf_type!r} is not one of {', '.join(GGUF_TYPES)}", option="gguf_type")
        if gguf_type is not None and not claimed:
            raise ArgumentError(
                f"gguf_type {gguf_type!r} writes one GGUF file: give an output ending in .gguf", option="gguf_type"
            )

    @classmethod
    def adjusted(cls, options):
        """The tensors made in the GGUF type's own float dtype where ``dtype`` is auto, laid out in the default dense
        output's shards (whose order the converter's tensor order is)."""
        return options.replace(dtype=dense_dtype(options.dtype, options.gguf_type), max_shard_size=DEFAULT_SHARD_BYTES)

    @classmethod
    def check_ready(cls) -> None:
        installed()  # read, not imported: its import begins with the command (begin_imports) or where first needed

    @classmethod
    def begin_imports(cls) -> None:
        """The converter's import begun on the preload thread, while the command resolves and plans."""
        start_importing()

    @classmethod
    def batch_output(cls, output_root, stem: str, options) -> str:
        return str(default_output(output_root, stem, f"{options.gguf_type}{GGUF_SUFFIX}"))

    def __init__(self, options, plan, name: str):
        super().__init__(options, plan, name)
        self.type = self.own_type = (
            options.gguf_type or FLOAT_TYPES[plan.dtype.short]
        )  # --dtype's float type by default
        self._vocabulary = None  # what the check recorded of the converter's vocabulary

    def default_output(self, output_dir, stem: str) -> Path:
        return default_output(output_dir, stem, f"{self.type}{GGUF_SUFFIX}")

    def check_plan(self) -> None:
        """What llama.cpp's converter refuses of this plan (architecture, tensor names, config fields, tokenizer),
        found without reading a weight (``converter.check``)."""
        plan = self.plan
        with staged(plan.folder, plan.config or {}, None, self.model) as stage:
            self._vocabulary = check(stage, tensors_of(plan), self.type, plan.folder)

    def size_bound(self) -> int:
        """At most the bytes of the GGUF: each tensor at the type's size (one-dimensional ones in fp32, as the converter
        writes them), padding, and the side files' bytes again for the metadata (the vocabulary)."""
        plan = self.plan
        per_value = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32}[self.type]
        values = sum(math.prod(tensor.shape) * (4 if len(tensor.shape) <= 1 else per_value) for tensor in plan.tensors)
        return int(values) + 32 * len(plan.tensors) + plan.side_bytes + (1 << 20)

    def what(self, planned: bool = False) -> str:
        if planned:
            return f"GGUF {self.type}, from {self.plan.dtype.name} tensors"
        return f"GGUF {self.type} (made from {self.plan.dtype.name})"

    def label(self) -> str:
        return f"GGUF {self.type}"

    def plan_lines(self) -> list[str]:
        architecture = (self.plan.config or {}).get("architectures", ["?"])[0]
        converter = f"llama.cpp's converter: takes {architecture}, its tensors and its tokenizer"
        return [f"{converter} (model name {self.model!r})"]

    def write(self, staging, output, reader, route, *, card, settings, progress, tensor_done) -> Written:
        return write_gguf(
            self.plan,
            staging / output.name,
            reader,
            route,
            gguf_type=self.type,
            name=self.model,
            card=card(),
            settings=settings,
            progress=progress,
            vocabulary=self._vocabulary,
        )

    def place(self, staging: Path, output: Path, *, overwrite: bool) -> int:
        size = (staging / output.name).stat().st_size
        lifecycle.move_file_into_place(staging, output, overwrite=overwrite)
        return size

    def pushed_card(self, card: str, output: Path) -> str:
        """The dense card (the one the converter read the metadata from), with a section on the file first."""
        from .converter import CONVERTER, CONVERTER_VERSION

        file_name = output.name
        section = (
            f"## GGUF\n\n`{file_name}` is a GGUF file of type {self.type}, written in one pass by nf4convert with "
            f"llama.cpp's converter ({CONVERTER} {CONVERTER_VERSION}): the file `convert_hf_to_gguf.py --outtype "
            f"{self.type}` writes from the dense weights this card describes, byte for byte, without a dense copy "
            "written in between."
        )
        closing = card.find("\n---\n", 3) if card.startswith("---\n") else -1
        if closing != -1:
            end = closing + len("\n---\n")
            return f"{card[:end]}\n{section}\n\n{card[end:].lstrip(chr(10))}"
        return f"{section}\n\n{card}"

    @classmethod
    def push(cls, output, repo_id, *, card, private, token, revision, progress) -> str:
        from ...hub.upload import push_file_to_hub

        return push_file_to_hub(
            output, repo_id, card=card, private=private, token=token, revision=revision, progress=progress
        )

    @classmethod
    def push_again(cls, output, repo_id, *, card, private, branch) -> str:
        """The file, then its model card (the push's README.md), written beside it as ``<stem>.README.md`` since the
        card lives nowhere else; a file of that name that is not this card is left as it is."""
        from ...hub.upload import upload_command

        output = Path(output)
        file = upload_command(repo_id, output, output.name, private=private, branch=branch)
        if card is None:
            return f"push it again with: {file}"
        kept = output.with_name(f"{output.stem}.README.md")
        try:
            if not kept.exists():
                _write_new(kept, card.encode("utf-8"))
            elif kept.read_bytes() != card.encode("utf-8"):
                return f"push it again with: {file} (its model card was not kept: {kept} is another file)"
        except OSError as error:
            return f"push it again with: {file} (its model card could not be kept: {error.strerror or error})"
        readme = upload_command(repo_id, kept, "README.md", private=private, branch=branch)
        return f"its model card is kept as {kept}; push both again with: {file} && {readme}"


def _write_new(path: Path, data: bytes) -> None:
    """``data`` as the new file ``path``, whole or not at all (OSError)."""
    handle = open(path, "xb")  # a file there already is not ours: FileExistsError
    try:
        with handle:
            handle.write(data)
    except OSError:
        path.unlink(missing_ok=True)
        raise
