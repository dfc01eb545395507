"""The safetensors sink, the default output: a folder of dense shards streamed from the plan through the pipeline,
with the index, config.json, the model card and the carried files beside them, as transformers saves a model.

Every shard's header is written first (the plan fixed every offset), so pieces land in any order. Two orders follow:

- shards are written ``settings.shards_at_once`` at a time, their pieces interleaved: buffered writes to one file
  serialize on its lock, writes to several run side by side;
- within a shard, plain tensors come first: they need no GPU, so they are written while the CUDA route starts;
- but a source streamed from the Hub (``reader.front_to_back``) is read fastest front to back (its hash needs its
  bytes in order, and bytes read ahead of it are held, or fetched again): then the shards' pieces are taken in the
  order of the source bytes they read, plain tensors in their place.

Delivered as it is made (``Delivery``: a push that keeps no local copy), the shards are written one at a time in
order, each handed over once closed, and a shard the destination holds already is not made.

Each range written has its writeback started at once (``safetensors_io.write.Writeback``), so the disk works from
the first byte rather than from when the page cache's dirty threshold is reached.
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Callable, Iterator

from ..pipeline.core import Pipeline
from ..plan import Plan, may_exceed
from ..safetensors_io.read import TensorReader
from ..safetensors_io.write import ShardWriter, Writeback
from ..settings import Settings
from ..sizes import counted
from . import output as lifecycle
from .base import Delivery, Sink, Written, register
from .naming import batch_output, default_output
from .side_files import write_side_files


def _shard_pieces(writer: ShardWriter, shard, reader: TensorReader, route, tensor_done: Callable[[], None]):
    """(writer, tensor name, piece) for every piece of one shard, its plain tensors first (a streamed source's in
    the plan's order, its files')."""
    first = not reader.front_to_back
    plain = [tensor for tensor in shard.tensors if first and tensor.recipe.plain]
    made = [tensor for tensor in shard.tensors if not (first and tensor.recipe.plain)]
    for tensor in plain + made:
        watched = may_exceed(tensor)
        for piece in tensor.recipe.produce(tensor, reader, route):
            piece.watched = watched
            yield writer, tensor.name, piece
        tensor_done()


def _interleaved(streams: list) -> Iterator:
    """One item of each stream in turn until all are done."""
    streams = list(streams)
    while streams:
        for stream in list(streams):
            item = next(stream, None)
            if item is None:
                streams.remove(stream)
            else:
                yield item


def _by_source(streams: list) -> Iterator:
    """The items of all streams, the one that reads the source furthest back first (each file is then read front to
    back, whichever shards read it)."""
    heads = []
    for order, stream in enumerate(streams):
        item = next(stream, None)
        if item is not None:
            heapq.heappush(heads, (_source_offset(item), order, item, stream))
    while heads:
        _, order, item, stream = heapq.heappop(heads)
        yield item
        item = next(stream, None)
        if item is not None:
            heapq.heappush(heads, (_source_offset(item), order, item, stream))


def _source_offset(item) -> int:
    _, _, piece = item
    return piece.source.begin + piece.first


def write_shards(
    plan: Plan,
    folder: Path,
    reader: TensorReader,
    route,
    *,
    progress: Callable[[int], None],
    tensor_done: Callable[[int], None] = lambda done: None,
    settings: Settings | None = None,
    delivery: Delivery | None = None,
) -> list[str]:
    """Write every shard of ``plan`` into ``folder``, making each tensor by its recipe on ``route``. Returns the names
    of the tensors written as fp16 with ±inf where their source may have held values beyond fp16's range
    (plan.may_exceed), in plan order. ``delivery``: shards written one at a time, in order, each handed over once
    closed (``Delivery.finished`` waits for room on the disk); those it does not want are skipped, counted as done."""
    done = 0

    def one_done() -> None:
        nonlocal done
        done += 1
        tensor_done(done)

    settings = settings or Settings()
    writeback = Writeback() if settings.writeback else None
    try:
        with Pipeline(route, reader, progress, writers=settings.writers) as pipeline:
            route.warm(plan, reader)
            writers: list[ShardWriter] = []
            try:
                at_once = 1 if delivery is not None else settings.shards_at_once
                for start in range(0, len(plan.shards), at_once):
                    group = plan.shards[start : start + at_once]
                    if delivery is not None and not delivery.wanted(group[0].filename):
                        progress(group[0].nbytes)
                        for _ in group[0].tensors:
                            one_done()
                        continue
                    opened = []
                    for shard in group:
                        opened.append(ShardWriter(folder / shard.filename, shard.tensors, writeback))
                        writers.append(opened[-1])
                    streams = [
                        _shard_pieces(writer, shard, reader, route, one_done) for writer, shard in zip(opened, group)
                    ]
                    ordered = _by_source(streams) if reader.front_to_back else _interleaved(streams)
                    for writer, name, piece in ordered:
                        pipeline.push(writer, name, piece)
                    pipeline.drain()
                    for writer in opened:
                        writer.close()
                    if delivery is not None:
                        delivery.finished(folder / group[0].filename)
            except BaseException:
                pipeline.close()  # no write may still be running when its file closes
                for writer in writers:
                    writer.discard()
                raise
            return [tensor.name for tensor in plan.tensors if tensor.name in pipeline.infinite]
    finally:
        if writeback is not None:
            writeback.close()


@register
class SafetensorsFolder(Sink):
    """A folder of dense safetensors shards, as transformers saves a model: the default output."""

    name = "safetensors"
    default = True
    delivers = True

    @classmethod
    def batch_output(cls, output_root, stem: str, options) -> str:
        return batch_output(output_root, stem, options.dtype)

    def default_output(self, output_dir, stem: str) -> Path:
        return default_output(output_dir, stem, self.plan.dtype.short)

    def size_bound(self) -> int:
        return self.plan.output_bytes

    def delivered_disk(self, on_disk: int) -> int:
        largest = sorted((shard.nbytes for shard in self.plan.shards), reverse=True)[:on_disk]
        return sum(largest) + self.plan.side_bytes

    def what(self, planned: bool = False) -> str:
        return self.plan.dtype.name

    def label(self) -> str:
        return self.plan.dtype.name

    def plan_lines(self) -> list[str]:
        plan = self.plan
        lines = [
            f"  {shard.filename}: {counted(len(shard.tensors), 'tensor')}, {shard.nbytes / 1e9:.3f} GB"
            for shard in plan.shards
        ]
        config = "rewritten" if plan.config else "none"
        lines.append(f"side files: {len(plan.side_files)} ({plan.side_bytes / 1e6:.1f} MB), config.json {config}")
        return lines

    def write(self, staging, output, reader, route, *, card, settings, progress, tensor_done, delivery=None):
        infinite = write_shards(
            self.plan,
            staging,
            reader,
            route,
            progress=progress,
            tensor_done=tensor_done,
            settings=settings,
            delivery=delivery,
        )
        write_side_files(self.plan, staging, card())
        return Written(len(self.plan.tensors), infinite)

    def place(self, staging: Path, output: Path, *, overwrite: bool) -> int:
        lifecycle.move_into_place(staging, output, overwrite=overwrite)
        return self.plan.tensor_bytes

    @classmethod
    def push(cls, output, repo_id, *, card, private, token, revision, progress) -> str:
        from ..hub.upload import push_to_hub

        return push_to_hub(output, repo_id, private=private, token=token, revision=revision, progress=progress)

    @classmethod
    def push_again(cls, output, repo_id, *, card, private, branch) -> str:
        from ..hub.upload import upload_command

        return f"push it again with: {upload_command(repo_id, output, '.', private=private, branch=branch)}"
