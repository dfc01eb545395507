"""Execute a plan: every output tensor's recipe, chunk by chunk, on one device, straight into its shard.

Peak memory is a few chunks (``CHUNK_ELEMENTS`` outputs of a quantized weight, ``CHUNK_BYTES`` of a plain
tensor), whatever the model or shard size: each shard's header is written first (the plan fixed every
offset), then the bytes, on a writer thread while the next chunk is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

from .checkpoint import ShardWriter, TensorReader
from .dtypes import DTYPES
from .formats import bnb4, bnb8, peft_lora
from .plan import Copy, Dequantize4bit, Dequantize8bit, MergeLora, Plan, PlannedTensor

CHUNK_ELEMENTS = 1 << 24  # outputs per step of a quantized weight: 32 MiB of bf16
CHUNK_BYTES = 1 << 25  # source bytes per step of a plain tensor


def _copy(tensor: PlannedTensor, reader: TensorReader, device) -> Iterator:
    import torch

    source = tensor.recipe.source
    source_type, target_type = DTYPES[source.dtype].torch, DTYPES[tensor.dtype].torch
    size = DTYPES[source.dtype].itemsize
    step = max(size, CHUNK_BYTES // size * size)
    for first in range(0, source.nbytes, step):
        data = reader.read(source, first, min(step, source.nbytes - first)).view(source_type)
        yield data.to(target_type) if source_type != target_type else data
    if source.nbytes == 0:
        yield torch.empty(0, dtype=torch.uint8)


def _dequantize_4bit(tensor: PlannedTensor, reader: TensorReader, device) -> Iterator:
    import torch

    from .dequantize import dequantize_4bit

    weight = tensor.recipe.weight
    state = bnb4.load_state(weight, reader, device)
    buffer = None
    for first, count, piece in bnb4.chunks(state, CHUNK_ELEMENTS, DTYPES[tensor.dtype].torch):
        if buffer is None:  # the first chunk is the largest
            buffer = torch.empty((count + 1) // 2, dtype=torch.uint8)
        packed = reader.read(weight.packed, first // 2, (count + 1) // 2, out=buffer).to(device)
        yield dequantize_4bit(packed, piece).cpu()


def _dequantize_8bit(tensor: PlannedTensor, reader: TensorReader, device) -> Iterator:
    import torch

    weight = tensor.recipe.weight
    rows, columns = weight.shape
    scb = reader.tensor(weight.scb).to(device)
    step = max(1, CHUNK_ELEMENTS // max(columns, 1))  # whole rows: each row has its own scale
    for first in range(0, rows, step):
        count = min(step, rows - first)
        codes = reader.read(weight.weight, first * columns, count * columns).view(torch.int8).view(count, columns)
        yield bnb8.dequantize(codes.to(device), scb[first : first + count], DTYPES[tensor.dtype].torch).cpu()


def _merge_lora(tensor: PlannedTensor, reader: TensorReader, device) -> Iterator:
    """The base tensor made whole on ``device`` (a merge needs all of it), merged, written out: one weight plus
    about two fp32 copies of it in memory at most."""
    import dataclasses

    import torch

    recipe = tensor.recipe
    base_tensor = dataclasses.replace(tensor, recipe=recipe.base)
    chunks = [chunk.reshape(-1) for chunk in PRODUCERS[type(recipe.base)](base_tensor, reader, device)]
    base = torch.cat(chunks).view(DTYPES[tensor.dtype].torch).to(device).view(tensor.shape)
    del chunks
    yield peft_lora.merge(recipe.target, base, peft_lora.read_lora(recipe.target, reader), inplace=True).contiguous().cpu()


# How each kind of recipe is made; verification.py holds the reference twin of this table.
PRODUCERS: dict[type, Callable[[PlannedTensor, TensorReader, object], Iterator]] = {
    Copy: _copy,
    Dequantize4bit: _dequantize_4bit,
    Dequantize8bit: _dequantize_8bit,
    MergeLora: _merge_lora,
}


class _Pipeline:
    """Writes chunks on a background thread while the next ones are computed (file writes and torch
    release the GIL); at most ``depth`` chunks wait, so memory stays bounded."""

    def __init__(self, progress: Callable[[int], None], depth: int = 2):
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nf4convert-writer")
        self._pending = deque()
        self._progress = progress
        self._depth = depth

    def emit(self, writer: ShardWriter, name: str, data) -> None:
        self._pending.append(self._pool.submit(writer.write, name, data))
        self._progress(data.numel() * data.element_size())
        while len(self._pending) > self._depth:
            self._pending.popleft().result()

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        for future in self._pending:
            future.cancel()
        self._pool.shutdown(wait=True)


def write_shards(plan: Plan, folder: Path, reader: TensorReader, device, *, progress: Callable[[int], None],
                 tensor_done: Callable[[int], None] = lambda done: None) -> None:  # fmt: skip
    """Write every shard of ``plan`` into ``folder``, making each tensor by its recipe on ``device``."""
    pipeline = _Pipeline(progress)
    done = 0
    try:
        for shard in plan.shards:
            writer = ShardWriter(folder / shard.filename, shard.tensors)
            for tensor in shard.tensors:
                for chunk in PRODUCERS[type(tensor.recipe)](tensor, reader, device):
                    pipeline.emit(writer, tensor.name, chunk)
                done += 1
                tensor_done(done)
            pipeline.drain()
            writer.close()
    finally:
        pipeline.close()
