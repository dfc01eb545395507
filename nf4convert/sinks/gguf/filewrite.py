"""The GGUF file written in one pass (``write_gguf``): llama.cpp's converter run with our tensors fed in the file's
order (``feed.py``), the fast paths' bytes (``fast.py``, ``streamed.py``) and the rest at their places
(``writes.py``), llama-quantize's step after it where asked (``requant.py``)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ... import profile
from ...dtypes import DTYPES
from ...errors import InternalError
from ...settings import Settings
from ..base import Written
from .converter import (
    Vocabulary,
    converter,
    converter_errors,
    converter_model,
    passing,
    quiet_converter,
    staged,
    tensors_of,
)
from .fast import FastTensor, recognise
from .feed import Feed
from .metadata import write_kv_data_to_file
from .q8_0 import Q8_0
from .requant import Requantization
from .streamed import GgufFileWrites, Layout, StreamedTensor
from .writes import WRITE_THREADS, PositionalWrites


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
    requant: Requantization | None = None,
) -> GgufWritten:
    """Write the GGUF that llama.cpp's converter makes from the dense checkpoint of ``plan`` into ``path``, reading the
    source through ``reader`` and making tensors on ``route``. ``name``: the model's name, as the converter would read
    it from the dense folder's name; ``card``: the dense model card. ``progress(bytes)`` as dense tensors are made.
    ``fast``: take the fast paths (off: the converter's own graph for every tensor). ``vocabulary``: the one the
    check of the same staged folder recorded (``converter.check``), written instead of reading the tokenizer again.
    ``requant``: llama-quantize's step from the converter's file of type ``gguf_type`` (a float type) taken in the same
    pass (``requant.py``): once the metadata is prepared, the writer's tensors and fields become llama-quantize's and
    the tensors whose type changes are quantized as they are written.

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
    write_threads = WRITE_THREADS
    if requant is not None:  # the writing threads quantize (numpy lets go of the interpreter's lock in its loops)
        writers = max(writers, cpu_cores())
        write_threads = max(write_threads, cpu_cores())
    retyped: dict = {}  # name -> requant.Retyped, once the metadata is prepared
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
    writes = PositionalWrites(descriptor, threads=write_threads, writeback=settings.writeback)
    streamed: list[StreamedTensor] = []

    def install(writer) -> None:
        """Every written tensor taken by a fast path where one gives its bytes (streamed where its values keep their
        order), and the feed started in writing order."""
        order = []
        for split in writer.tensors:
            for tensor_name, info in split.items():
                recognised = recognise(info.tensor, is_source, gguf) if fast else None
                change = retyped.get(tensor_name)
                change = change if change is not None and change.changed else None
                if change is not None and recognised is not None and recognised.kind != "same":
                    recognised = None  # llama-quantize's input is not what this fast path makes
                if recognised is None:
                    order += _sources(info.tensor, is_source)
                    written.tensors += 1
                    continue
                stream = None
                if recognised.streamed:
                    source = recognised.source
                    stream = StreamedTensor(
                        tensor_name, recognised.kind, dtypes[source], info.nbytes, pieces, retyped=change
                    )
                    streamed.append(stream)
                    order.append((source, stream))
                else:
                    order.append(recognised.source)
                device = route.device if recognised.kind == "q8_0" else "cpu"  # nothing to compute for the rest
                info.tensor = FastTensor(
                    recognised, info.nbytes, feed.take, device, quantizer, lambda: writes, stream=stream, retyped=change
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
            prepare_metadata = model.prepare_metadata

            @passing
            def prepared():
                with quiet_converter(written.warnings):  # its words on the tensors (a type it falls back from)
                    prepare_tensors()
                if requant is None:
                    install(writer)
                profile.mark("GGUF tensors prepared")

            @passing
            def prepared_metadata(vocab_only):
                prepare_metadata(vocab_only=vocab_only)
                retyped.update(requant.apply(writer, gguf))  # the plan reads the model's fields: known only now
                for tensor in retyped.values():  # the GPU route quantizes on its GPU
                    tensor.device = route.device if route.gpu else None
                install(writer)

            def write_tensors_in_place(progress=False):  # our bar, not its
                _write_tensors(writer, gguf, pieces, descriptor, writes, retyped)
                writes.finish()
                feed.finish()
                if not all(stream.complete() for stream in streamed):
                    raise InternalError(f"{path}: a Q8_0 block was left without all its values")

            model.prepare_tensors = prepared
            if requant is not None:
                model.prepare_metadata = prepared_metadata
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


def _write_tensors(writer, gguf, pieces: GgufFileWrites, descriptor: int, writes: PositionalWrites, retyped) -> None:
    """In place of gguf-py's ``write_tensors_to_file``: the tensor infos written and the data's place known (the
    streamed pieces held meanwhile written, those waiting for it going on), then each tensor made whole converted and
    handed to the positional writes at its place; the padding between tensors and after the last is a hole of zeros,
    as gguf-py writes it. A tensor of ``retyped`` (name -> ``requant.Retyped``) whose type changes is quantized from
    the converter's bytes as it is written."""
    import numpy as np

    from .fast import put_requantized

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
            change = retyped.get(tensor_name)
            if change is not None and change.changed:
                put_requantized(writes, offsets[tensor_name], made.reshape(-1).view(np.uint8), change)
                continue
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
