"""Reading safetensors checkpoints at the byte level: strict headers, the shard index, and positional reads.

The format (safetensors' docs): an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets relative to the end of
the header), then the raw little-endian tensor bytes. Reading is as strict as the safetensors library, and stricter
where a malformed file would otherwise reach a user as a traceback (below).
"""

from __future__ import annotations

import os
import re
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..dtypes import DTYPES
from ..errors import CheckpointError
from ..files import ADAPTER_WEIGHTS, INDEX_NAME, inside, plain_relative, read_regular
from ..strict_json import shown, strict_json


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


HEADER_LIMIT = 100_000_000
_USIZE_END = 1 << 64
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
_INDEX_LIMIT = 100_000_000  # an index lists names; real ones are kilobytes


def _itemsize(code: str) -> int:
    return DTYPES[code].itemsize


def _is_size(value) -> bool:
    return type(value) is int and 0 <= value < _USIZE_END  # noqa: E721  (bool is an int subclass: refused)


def _check_tensor_name(name, where: str) -> None:
    # isprintable() is False for control characters, line separators and lone surrogates (serde_json refuses those).
    if not isinstance(name, str) or not name or not name.isprintable():
        raise CheckpointError(f"{where}: tensor name {shown(name)} is empty or has control characters")


def _header_entry(path: Path, name: str, entry) -> tuple[str, tuple, int, int, int]:
    """(dtype, shape, begin, end, nbytes) of one header entry, its types and sizes checked."""
    where = f"{path}: tensor {shown(name)}"
    if not isinstance(entry, dict) or entry.keys() != _ENTRY_KEYS:
        found = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise CheckpointError(
            f"{where}: header entry must have exactly dtype, shape and data_offsets, not {shown(found)}"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {shown(dtype)}")
    if not isinstance(shape, list) or not all(_is_size(d) for d in shape):
        raise CheckpointError(f"{where}: malformed shape {shown(shape)} (a list of non-negative integers)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_size(o) for o in offsets):
        raise CheckpointError(f"{where}: malformed data_offsets {shown(offsets)} (two non-negative integers)")
    elements = 1
    for dim in shape:  # stops at the first overflow, as safetensors' checked_mul does (a later 0 does not rescue it)
        elements *= dim
        if elements >= _USIZE_END:
            raise CheckpointError(f"{where}: shape {shown(shape)} has more elements than fit in 64 bits")
    nbytes = elements * _itemsize(dtype)
    if nbytes * 8 >= _USIZE_END:  # safetensors counts bits
        raise CheckpointError(f"{where}: shape {shown(shape)} of {dtype} has more bits than fit in 64 bits")
    return dtype, tuple(shape), offsets[0], offsets[1], nbytes


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict]:
    """The tensors of one safetensors file (name -> TensorInfo) and its metadata, checked as strictly as
    safetensors' own reader does (and stricter where noted above); CheckpointError naming file and tensor."""
    try:
        status = os.stat(path)
        if not stat.S_ISREG(status.st_mode):  # a FIFO or device would block or never end
            raise CheckpointError(f"{path}: not a regular file")
        size = status.st_size
        with open(path, "rb") as file:
            prefix = file.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (length,) = struct.unpack("<Q", prefix)
            if length > HEADER_LIMIT or 8 + length > size:
                raise CheckpointError(
                    f"{path}: corrupt or truncated safetensors header (length {length}, file {size} bytes)"
                )
            raw = file.read(length)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read ({error.strerror or error})") from None
    if len(raw) != length:
        raise CheckpointError(f"{path}: truncated while reading its header")
    header = strict_json(raw, f"{path}: corrupt safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: corrupt safetensors header ('__metadata__' is not a map of strings to strings)")
    for text in (*metadata, *metadata.values()):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate escape, which serde_json refuses
            raise CheckpointError(
                f"{path}: corrupt safetensors header ('__metadata__' holds an invalid \\u escape)"
            ) from None
    entries = []
    for name, entry in header.items():
        _check_tensor_name(name, str(path))
        entries.append((name, *_header_entry(path, name, entry)))
    # safetensors sorts by offsets and then requires the data to be tiled exactly: no gap, no overlap.
    entries.sort(key=lambda e: (e[3], e[4]))
    data_start = 8 + length
    tensors = {}
    position = 0
    for name, dtype, shape, begin, end, nbytes in entries:
        where = f"{path}: tensor {shown(name)}"
        if begin != position:
            what = "overlaps the tensor before it" if begin < position else "leaves a gap before it"
            raise CheckpointError(f"{where}: data_offsets {[begin, end]} {what} (the data must begin at {position})")
        if end < begin:
            raise CheckpointError(f"{where}: data_offsets {[begin, end]} end before they begin")
        if end - begin != nbytes:
            raise CheckpointError(
                f"{where}: has {end - begin} bytes, its shape {list(shape)} of {dtype} needs {nbytes}"
            )
        position = end
        tensors[name] = TensorInfo(name, dtype, shape, data_start + begin, data_start + end, path)
    if data_start + position != size:
        if data_start + position > size:
            last = shown(entries[-1][0])
            raise CheckpointError(
                f"{path}: truncated: tensor {last} ends at byte {data_start + position}, the file has {size}"
            )
        raise CheckpointError(
            f"{path}: {size - data_start - position} bytes after the last tensor, which its header does not describe"
        )
    return tensors, metadata


def read_index(folder: Path) -> dict[str, str] | None:
    """The ``weight_map`` of model.safetensors.index.json (tensor -> file), or None when there is none.

    Every file it names must be a ``.safetensors`` file named by a plain relative path inside ``folder``
    (no ``..``, no absolute path or drive, no backslash); CheckpointError otherwise.
    """
    path = folder / INDEX_NAME
    if not os.path.lexists(path):
        candidates = sorted(folder.glob("*.safetensors.index.json"))
        if not candidates:
            return None
        path = candidates[0]
    path = inside(folder, path.name)
    try:
        raw = read_regular(path, _INDEX_LIMIT)
    except FileNotFoundError as error:  # a dangling link
        raise CheckpointError(f"{path}: cannot read ({error.strerror})") from None
    index = strict_json(raw, f"{path}: corrupt index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: corrupt index (no 'weight_map' object)")
    for name, file in weight_map.items():
        _check_tensor_name(name, str(path))
        plain_relative(folder, file, f"{path}: tensor {shown(name)}")
    return weight_map


_SHARD_NAME = re.compile(r"(.+)-[0-9]+-of-([0-9]+)\.safetensors")  # transformers' "model-00001-of-00003.safetensors"


def _unlisted_shards(folder: Path, listed: set[str]) -> set[str]:
    """Files of the shard series the index names (same prefix, same "-of-N") that it does not name: a shard the index
    lost, whose tensors would silently be left out. Other .safetensors files beside an index (a Mistral repo's
    consolidated.safetensors, an older series "-of-M") are not the checkpoint's and stay unread."""
    names = []
    for parent in {match[1].rpartition("/")[0] for file in listed if (match := _SHARD_NAME.fullmatch(file))}:
        try:
            names += [
                f"{parent}/{name}" if parent else name for name in os.listdir(folder / parent if parent else folder)
            ]
        except OSError:
            continue  # a listed file there is then reported missing or unreadable by its own name
    return series_members(listed, names)


def series_members(listed: set[str], names: Iterable[str]) -> set[str]:
    """Of ``names`` (files by relative path), those of the shard series of the ``listed`` files (same prefix, same
    "-of-N") that are not listed (here and for a Hub repo's files, hub._copy_for_plan)."""
    series = {match.groups() for file in listed if (match := _SHARD_NAME.fullmatch(file))}
    return {
        name
        for name in names
        if name not in listed and (match := _SHARD_NAME.fullmatch(name)) and match.groups() in series
    }


_SHARD_NUMBER = re.compile(r"(.+)-([0-9]+)-of-([0-9]+)\.safetensors")


def _check_series(folder: Path, files: list[str]) -> None:
    """Every numbered shard series among ``files`` complete: "-00001-of-00003" to "-00003-of-00003", none missing (a
    download or copy that stopped, an index edited to match what is left) and none past its count. CheckpointError
    naming the first shard missing otherwise: the checkpoint's weights in it would be silently left out."""
    series: dict[tuple[str, int], dict[int, str]] = {}
    for file in files:
        match = _SHARD_NUMBER.fullmatch(file)
        if match:
            series.setdefault((match[1], int(match[3])), {})[int(match[2])] = file
    for (prefix, count), numbered in sorted(series.items()):
        width = len(next(iter(numbered.values())).rsplit("-of-", 1)[1]) - len(".safetensors")
        beyond = sorted(number for number in numbered if not 1 <= number <= count)
        if beyond:
            raise CheckpointError(f"{folder / numbered[beyond[0]]}: shard {beyond[0]} of a series of {count}")
        missing = [number for number in range(1, count + 1) if number not in numbered]
        if missing:
            name = f"{prefix}-{missing[0]:0{width}d}-of-{count:0{width}d}.safetensors"
            raise CheckpointError(
                f"{folder / name}: missing, {len(missing)} of the {count} shards of the series are (an interrupted "
                "download or copy?); the weights in them would be left out of the output"
            )


def read_tensors(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint in ``folder``, resolved through the index when there is one.

    With an index, the index and the shards must agree exactly: each tensor listed under the file that holds it,
    and every tensor of those files, and of the index's shard series, listed (CheckpointError naming the shard and
    the tensor otherwise)."""
    weight_map = read_index(folder)
    if weight_map is not None:
        listed = set(weight_map.values())
        files = sorted(listed | _unlisted_shards(folder, listed))
    else:
        # Without an index every .safetensors file is the checkpoint's, but for a peft adapter's own file.
        files = sorted(
            plain_relative(folder, p.name, str(folder))
            for p in folder.glob("*.safetensors")
            if p.name != ADAPTER_WEIGHTS
        )
    if not files:
        raise CheckpointError(f"{folder}: no .safetensors files (only safetensors checkpoints can be converted)")
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        path = inside(folder, file)
        try:
            regular = stat.S_ISREG(os.stat(path).st_mode)
        except FileNotFoundError:
            missing = "listed in the index but missing" if weight_map is None or file in listed else "a dangling link"
            raise CheckpointError(f"{path}: {missing}") from None
        except OSError as error:  # a name too long, a link loop, no permission
            raise CheckpointError(f"{path}: cannot read ({error.strerror or error})") from None
        if not regular:
            raise CheckpointError(f"{path}: not a regular file")
        for name, info in read_header(path)[0].items():
            if name in tensors:
                raise CheckpointError(f"{path}: tensor {shown(name)} also stands in {tensors[name].path.name}")
            # transformers loads every tensor of every file the index names (and no other file), while other readers
            # (vLLM, mergekit) look each tensor up in the index: a tensor the index leaves out, or lists under another
            # file, is read by one and not the other, or by none; refused, never silently dropped.
            if weight_map is not None and weight_map.get(name) != file:
                listed = "does not list" if name not in weight_map else f"lists under {shown(weight_map[name])}"
                raise CheckpointError(f"{path}: holds tensor {shown(name)}, which the index {listed}")
            tensors[name] = info
    _check_series(folder, files)
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors:
                raise CheckpointError(
                    f"{folder / file}: the index lists tensor {shown(name)} but the file does not hold it"
                )
    return tensors


def as_array(data):
    """A numpy array as it is, a CPU tensor as a numpy array on its bytes (torch is not imported for numpy arrays)."""
    if hasattr(data, "__array_interface__"):
        return data
    import torch

    return data.contiguous().view(-1).view(torch.uint8).numpy()


class TensorReader:
    """Reads tensors' bytes from their files, keeping the files open; tensors come back on the CPU.

    ``held`` (file -> byte ranges) marks files that hold only those ranges (a Hub repo's copy for a plan alone,
    ``hub.HeadersOnly``): reading any other bytes of them is a CheckpointError, never the zeros of a hole, unless
    ``remote`` (file -> what reads it: ``pread(offset, buffer)``) has the file: then they are read through it (a Hub
    file streamed, or the Hub cache's copy, checked as it is read: ``hub.weights``). ``front_to_back``: its files are
    read fastest front to back (streamed), which a sink's order of reads may follow."""

    def __init__(self, held: dict[Path, list[tuple[int, int]]] | None = None, remote: dict | None = None):
        self._files: dict[Path, object] = {}
        self._opening = threading.Lock()  # the stream reads from several threads
        self._held = held
        self._remote = remote
        self.front_to_back = False

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
        """Bytes ``[first_byte, first_byte + count)`` of a tensor as a uint8 tensor, or into ``out`` (a uint8 numpy
        array or CPU tensor, returned as ``out[:count]``).

        Positional reads (no shared file position): safe from several threads at once.
        """
        count = info.nbytes - first_byte if count is None else count
        remote = self._remote.get(info.path) if self._remote else None
        if self._held is not None and info.path in self._held:
            first, end = info.begin + first_byte, info.begin + first_byte + count
            if any(a <= first and end <= b for a, b in self._held[info.path]):
                remote = None  # the copy holds these bytes
            elif remote is None:
                raise CheckpointError(
                    f"{info.path}: tensor '{info.name}' ({info.nbytes} bytes) was not read from the Hub: "
                    "a dry run reads only headers and quant states; a conversion reads the weights"
                )
        if out is None:
            import torch

            out = torch.empty(count, dtype=torch.uint8)
        buffer = out[:count]
        view = memoryview(as_array(buffer)) if count else memoryview(b"")
        if remote is not None:
            remote.pread(info.begin + first_byte, view)
            return buffer
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
        data = self.read(info)
        return data.view(DTYPES[info.dtype].torch).reshape(info.shape)

    def array(self, info: TensorInfo):
        """A tensor's bytes as a flat uint8 numpy array (no torch)."""
        import numpy as np

        return self.read(info, out=np.empty(info.nbytes, dtype=np.uint8))

    def close(self):
        for handle in self._files.values():
            handle.close()
        self._files.clear()
