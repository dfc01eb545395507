"""Safetensors at the byte level: headers, the shard index, tensor reads, and the streaming writer.

The format (see safetensors' docs): an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets
relative to the end of the header), then the raw little-endian tensor bytes. It is simple enough
to write directly, which lets the writer put each tensor's bytes in place as soon as they exist:
a whole shard is never held in memory.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .dtypes import DTYPES
from .errors import CheckpointError

MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple
    begin: int  # absolute file offsets
    end: int
    path: Path

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict]:
    """The tensors of one safetensors file (name -> TensorInfo) and its metadata, checked."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            prefix = file.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER or 8 + length > size:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors header (length {length}, file {size} bytes)")
            raw = file.read(length)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read ({error.strerror or error})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + length
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{path}: tensor '{name}' has a malformed header entry") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor '{name}' has unknown dtype {dtype!r}")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CheckpointError(f"{path}: tensor '{name}' has a malformed shape {list(shape)}")
        if end - begin != math.prod(shape) * DTYPES[dtype].itemsize or begin < 0:
            raise CheckpointError(f"{path}: tensor '{name}' has {end - begin} bytes, its shape {list(shape)} of {dtype} needs {math.prod(shape) * DTYPES[dtype].itemsize}")
        if data_start + end > size:
            raise CheckpointError(f"{path}: truncated: tensor '{name}' ends at byte {data_start + end}, the file has {size}")
        tensors[name] = TensorInfo(name, dtype, shape, data_start + begin, data_start + end, path)
    return tensors, metadata


def read_index(folder: Path) -> dict[str, str] | None:
    """The ``weight_map`` of model.safetensors.index.json (tensor -> file), or None when there is none."""
    path = folder / "model.safetensors.index.json"
    if not path.exists():
        candidates = sorted(folder.glob("*.safetensors.index.json"))
        if not candidates:
            return None
        path = candidates[0]
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{path}: corrupt index (no readable 'weight_map')") from None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: corrupt index ('weight_map' is not an object)")
    return weight_map


def read_tensors(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint in ``folder``, resolved through the index when there is one."""
    weight_map = read_index(folder)
    if weight_map is not None:
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no .safetensors files (only safetensors checkpoints can be converted)")
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        path = folder / file
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the index but missing")
        for name, info in read_header(path)[0].items():
            if name in tensors:
                raise CheckpointError(f"{path}: tensor '{name}' also stands in {tensors[name].path.name}")
            tensors[name] = info
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors:
                raise CheckpointError(f"{folder / file}: the index lists tensor '{name}' but the file does not hold it")
    return tensors


class TensorReader:
    """Reads tensors' bytes from their files, keeping the files open; tensors come back on the CPU."""

    def __init__(self):
        import threading

        self._files: dict[Path, object] = {}
        self._opening = threading.Lock()  # the stream reads from several threads

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def _file(self, path: Path):
        handle = self._files.get(path)
        if handle is None:
            with self._opening:
                handle = self._files.get(path)
                if handle is None:
                    try:
                        handle = self._files[path] = open(path, "rb")  # noqa: SIM115  (closed in close())
                    except OSError as error:
                        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from None
        return handle

    def read(self, info: TensorInfo, first_byte: int = 0, count: int | None = None, out=None):
        """Bytes ``[first_byte, first_byte + count)`` of a tensor as a uint8 tensor (into ``out`` if given).

        Positional reads (no shared file position): safe from several threads at once.
        """
        import os

        import torch

        count = info.nbytes - first_byte if count is None else count
        buffer = torch.empty(count, dtype=torch.uint8) if out is None else out[:count]
        view = memoryview(buffer.numpy()) if count else memoryview(b"")
        descriptor = self._file(info.path).fileno()
        done = 0
        try:
            while done < count:  # Linux reads at most ~2 GiB per call
                got = os.preadv(descriptor, [view[done:]], info.begin + first_byte + done)
                if got == 0:
                    raise CheckpointError(f"{info.path}: truncated while reading tensor '{info.name}'")
                done += got
        except OSError as error:
            raise CheckpointError(f"{info.path}: cannot be read ({error.strerror or error})") from None
        return buffer

    def tensor(self, info: TensorInfo):
        import torch

        data = self.read(info)
        return data.view(DTYPES[info.dtype].torch).reshape(info.shape)

    def close(self):
        for handle in self._files.values():
            handle.close()
        self._files.clear()


def shard_header(tensors: Iterable) -> bytes:
    """The 8-byte length and JSON header for these tensors (``name``, ``dtype``, ``shape``, ``nbytes``) in this order,
    padded to 8 bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads with spaces so the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """Writes one shard: the header first, then each tensor's bytes, either appended in header order
    (``write(name, data)``) or put at their planned place (``write(name, data, offset=...)``, from any
    number of threads at once: positional writes)."""

    def __init__(self, path: Path, tensors: list):
        import os
        import threading

        self.path = path
        self.tensors = tensors
        header = shard_header(tensors)
        self._descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        self._begin: dict[str, int] = {}
        position = len(header)
        for tensor in tensors:
            self._begin[tensor.name] = position
            position += tensor.nbytes
        self._nbytes = {tensor.name: tensor.nbytes for tensor in tensors}
        self._written = dict.fromkeys(self._begin, 0)
        self._lock = threading.Lock()
        self._next = 0  # the tensor appended to next (header order)
        self._pwrite(header, 0)

    def _pwrite(self, view, position: int) -> None:
        import os

        view = memoryview(view)
        while len(view):  # a regular file takes at most ~2 GiB per call
            done = os.pwrite(self._descriptor, view, position)
            view, position = view[done:], position + done

    def write(self, name: str, data, offset: int | None = None) -> None:
        """Bytes (a CPU tensor, any dtype, contiguous) of tensor ``name``: appended after the bytes it has
        (call in header order), or at byte ``offset`` of the tensor."""
        import torch

        view = memoryview(data.contiguous().view(-1).view(torch.uint8).numpy())
        if offset is None:
            expected = self.tensors[self._next] if self._next < len(self.tensors) else None
            if expected is None or expected.name != name:
                raise RuntimeError(f"{self.path}: wrote '{name}' where '{expected and expected.name}' comes next")
            offset = self._written[name]
        elif name not in self._begin:
            raise RuntimeError(f"{self.path}: '{name}' is not planned in this shard")
        planned = self._nbytes[name]
        if offset + len(view) > planned:
            raise RuntimeError(f"{self.path}: '{name}' got bytes up to {offset + len(view)}, {planned} planned")
        self._pwrite(view, self._begin[name] + offset)
        with self._lock:
            self._written[name] += len(view)
            tensors = self.tensors
            while self._next < len(tensors) and self._written[tensors[self._next].name] >= tensors[self._next].nbytes:
                self._next += 1

    def discard(self) -> None:
        """Close the file, written or not (the run failed; its folder goes)."""
        import os

        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None

    def close(self) -> None:
        # No fsync: the folder only gets its final name once every shard is closed, so an
        # interrupted run never looks finished; durability across power loss is the OS's.
        unwritten = [t.name for t in self.tensors if self._written[t.name] != t.nbytes]
        self.discard()
        if unwritten:
            raise RuntimeError(f"{self.path}: closed with {len(unwritten)} tensors unwritten")
