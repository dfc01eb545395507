"""Safetensors at the byte level: headers, the shard index, tensor reads, and the streaming writer.

The format (see safetensors' docs): an 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, offsets
relative to the end of the header), then the raw little-endian tensor bytes. It is simple enough
to write directly, which lets the writer put each tensor's bytes in place as soon as they exist:
a whole shard is never held in memory.
"""

from __future__ import annotations

import json
import os
import queue
import re
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .dtypes import DTYPES
from .errors import CheckpointError

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


# What reading refuses, and where that is stricter than safetensors itself (safetensors/src/tensor.rs,
# read_metadata and Metadata::validate, which safe_open runs on the whole file):
# - as safetensors: a header over 100 MB (its MAX_HEADER_SIZE, decimal) or past the end of the file; a header
#   that is not UTF-8 JSON (serde_json: no NaN/Infinity, no lone surrogates, nesting bounded) or not an object;
#   an entry whose dtype, shape or data_offsets is missing or not of the right type (sizes are usize: integers,
#   not bools or floats, 0 <= x < 2**64, shape product and bit count without overflow); tensors that, sorted by
#   offsets, do not begin where the previous one ends (the first at 0), whose byte count does not match; a last
#   end that is not exactly the data size (trailing bytes too); `__metadata__` that is not a str -> str map.
# - stricter: duplicate keys (serde keeps the last tensor silently), keys besides dtype/shape/data_offsets in an
#   entry, empty or non-printable tensor names (they would break one-line messages), dtypes without a torch
#   type here (F4, F6_*, F8_E8M0, C64, ...).
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file name: an adapter beside a checkpoint is not part of it
INDEX_NAME = "model.safetensors.index.json"  # transformers' name for the index (the only one it looks for)
_HEADER_LIMIT = 100_000_000
_USIZE_END = 1 << 64
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
_INDEX_LIMIT = 100_000_000  # an index lists names; real ones are kilobytes
_SHOWN_CHARS = 120  # a hostile name or value is shortened in messages, so an error stays one readable line


def _itemsize(code: str) -> int:
    return DTYPES[code].itemsize


def shown(value) -> str:
    """``value`` for a one-line message: quoted if a printable name, else its ascii() repr; shortened."""
    text = f"'{value}'" if isinstance(value, str) and value.isprintable() else ascii(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 5] + "...'"


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs):
    result = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _refuse_constant(name):
    raise ValueError(f"{name} is not JSON")


def _parse_int(text: str):
    # serde_json reads "-0" as a negative integer, which no usize field takes; int() would make it a plain 0.
    return -0.0 if text == "-0" else int(text)


JSON_DEPTH = 64  # nesting that JSON read here may have (configs nest 4 or 5 deep; code walking them recurses)


def _depth_within(value, limit: int) -> bool:
    """Whether ``value`` nests at most ``limit`` lists/objects deep (walked without recursion)."""
    level = [value]
    for _ in range(limit + 1):
        level = [item for node in level if isinstance(node, (dict, list)) for item in (node.values() if isinstance(node, dict) else node)]
        if not level:
            return True
    return False


def strict_json(raw: bytes, where: str):
    """Parse ``raw`` as serde_json would, and refuse duplicate keys and nesting past JSON_DEPTH; CheckpointError
    ``where: ...`` if not."""
    try:
        value = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_refuse_constant,
                           parse_int=_parse_int)
        if not _depth_within(value, JSON_DEPTH):
            raise RecursionError
        return value
    except _DuplicateKey as error:
        raise CheckpointError(f"{where}: key {shown(error.args[0])} appears twice") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{where}: not UTF-8") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{where}: not JSON ({error.msg} at character {error.pos})") from None
    except RecursionError:
        raise CheckpointError(f"{where}: not JSON that can be read (nested too deeply)") from None
    except ValueError as error:  # NaN/Infinity, or an integer of thousands of digits
        raise CheckpointError(f"{where}: not JSON that can be read ({str(error).split(';')[0]})") from None


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
        raise CheckpointError(f"{where}: header entry must have exactly dtype, shape and data_offsets, not {shown(found)}")
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
            if length > _HEADER_LIMIT or 8 + length > size:
                raise CheckpointError(f"{path}: corrupt or truncated safetensors header (length {length}, file {size} bytes)")
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
            raise CheckpointError(f"{path}: corrupt safetensors header ('__metadata__' holds an invalid \\u escape)") from None
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
            raise CheckpointError(f"{where}: has {end - begin} bytes, its shape {list(shape)} of {dtype} needs {nbytes}")
        position = end
        tensors[name] = TensorInfo(name, dtype, shape, data_start + begin, data_start + end, path)
    if data_start + position != size:
        if data_start + position > size:
            last = shown(entries[-1][0])
            raise CheckpointError(f"{path}: truncated: tensor {last} ends at byte {data_start + position}, the file has {size}")
        raise CheckpointError(f"{path}: {size - data_start - position} bytes after the last tensor, which its header does not describe")
    return tensors, metadata


def _plain_relative(folder: Path, file, where: str) -> str:
    """``file`` if it names a ``.safetensors`` file by a plain relative path inside ``folder``."""
    from pathlib import PureWindowsPath

    if not isinstance(file, str) or not file:
        raise CheckpointError(f"{where}: file name {shown(file)} is not a non-empty string")
    parts = file.split("/")
    if (not file.isprintable() or "\\" in file or PureWindowsPath(file).drive or file.startswith("/")
            or any(part in ("", ".", "..") for part in parts)):  # fmt: skip
        raise CheckpointError(f"{where}: file name {shown(file)} is not a plain relative path inside {folder}")
    if any(len(part.encode("utf-8", "surrogatepass")) > 255 for part in parts):  # no file system takes more
        raise CheckpointError(f"{where}: file name {shown(file)} is too long")
    if not file.endswith(".safetensors"):
        raise CheckpointError(f"{where}: file name {shown(file)} is not a .safetensors file")
    return file


def inside(folder: Path, file: str, *, what: str = "checkpoint") -> Path:
    """``folder / file``, refused when it resolves (through symlinks) outside ``folder`` (the ``what`` folder: a
    checkpoint's, or an adapter's, whose files are read by the same rule).

    A symlink whose target stays inside the folder is fine. So is the Hub cache's layout, where
    ``<repo>/snapshots/<rev>/<file>`` is a symlink to ``<repo>/blobs/<hash>``: a snapshot folder may read
    its repo's blobs, nothing else. Any other way out (an index name was checked already, so a symlink
    that a git clone or an archive planted) could put a file the user never meant to share into the output.
    """
    path = folder / file
    try:
        root = folder.resolve()
        real = path.resolve()
        blobs = (root.parent.parent / "blobs").resolve() if root.parent.name == "snapshots" else None
    except (OSError, RuntimeError) as error:  # RuntimeError: a symlink loop (Python < 3.13)
        raise CheckpointError(f"{path}: cannot be resolved ({error})") from None
    if real == root or root in real.parents or (blobs is not None and real.parent == blobs):
        return path
    raise CheckpointError(f"{path}: is a link to {real}, outside the {what} folder; copy the file into the folder instead")


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
        with open(path, "rb") as file:
            raw = file.read(_INDEX_LIMIT + 1)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot read ({error.strerror or error})") from None
    if len(raw) > _INDEX_LIMIT:
        raise CheckpointError(f"{path}: corrupt index (over {_INDEX_LIMIT} bytes)")
    index = strict_json(raw, f"{path}: corrupt index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: corrupt index (no 'weight_map' object)")
    for name, file in weight_map.items():
        _check_tensor_name(name, str(path))
        _plain_relative(folder, file, f"{path}: tensor {shown(name)}")
    return weight_map


_SHARD_NAME = re.compile(r"(.+)-[0-9]+-of-([0-9]+)\.safetensors")  # transformers' "model-00001-of-00003.safetensors"


def _unlisted_shards(folder: Path, listed: set[str]) -> set[str]:
    """Files of the shard series the index names (same prefix, same "-of-N") that it does not name: a shard the index
    lost, whose tensors would silently be left out. Other .safetensors files beside an index (a Mistral repo's
    consolidated.safetensors, an older series "-of-M") are not the checkpoint's and stay unread."""
    names = []
    for parent in {match[1].rpartition("/")[0] for file in listed if (match := _SHARD_NAME.fullmatch(file))}:
        try:
            names += [f"{parent}/{name}" if parent else name for name in os.listdir(folder / parent if parent else folder)]
        except OSError:
            continue  # a listed file there is then reported missing or unreadable by its own name
    return series_members(listed, names)


def series_members(listed: set[str], names: Iterable[str]) -> set[str]:
    """Of ``names`` (files by relative path), those of the shard series of the ``listed`` files (same prefix, same
    "-of-N") that are not listed (here and for a Hub repo's files, hub._copy_for_plan)."""
    series = {match.groups() for file in listed if (match := _SHARD_NAME.fullmatch(file))}
    return {name for name in names if name not in listed and (match := _SHARD_NAME.fullmatch(name)) and match.groups() in series}


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
        files = sorted(_plain_relative(folder, p.name, str(folder)) for p in folder.glob("*.safetensors")
                       if p.name != ADAPTER_WEIGHTS)  # fmt: skip
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
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in tensors:
                raise CheckpointError(f"{folder / file}: the index lists tensor {shown(name)} but the file does not hold it")
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
    ``hub.HeadersOnly``): reading any other bytes of them is a CheckpointError, never the zeros of a hole."""

    def __init__(self, held: dict[Path, list[tuple[int, int]]] | None = None):
        self._files: dict[Path, object] = {}
        self._opening = threading.Lock()  # the stream reads from several threads
        self._held = held

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
        if self._held is not None and info.path in self._held:
            first, end = info.begin + first_byte, info.begin + first_byte + count
            if not any(a <= first and end <= b for a, b in self._held[info.path]):
                raise CheckpointError(f"{info.path}: tensor '{info.name}' ({info.nbytes} bytes) was not read from the Hub: "
                                      "a dry run reads only headers and quant states; a conversion downloads the weights")  # fmt: skip
        if out is None:
            import torch

            out = torch.empty(count, dtype=torch.uint8)
        buffer = out[:count]
        view = memoryview(as_array(buffer)) if count else memoryview(b"")
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


# Files that hold a model's weights, by what reads them (one list, three uses: the plan never carries them over, verify
# names any in OUT that a conversion did not write, a push deletes a repo's that the output lacks). LOADED: read as
# the weights unasked: safetensors and PyTorch .bin (transformers, vLLM, with their indexes), .pt (vLLM), .pth (Meta's
# and Mistral's reference code), transformers 4's TF and Flax weights. NAMED: read only when a tool is pointed at
# them (GGUF, other checkpoints). ADAPTER: a peft adapter's, with which transformers loads the base it names plus
# the adapter instead of the weights beside it.
LOADED_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth",
                       "*.h5", "*.msgpack")  # fmt: skip
NAMED_WEIGHT_FILES = ("*.ckpt", "*.gguf")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.*")


# What every output shard's header says of itself, as torch's save_file writes it (verify checks it).
SHARD_METADATA = {"format": "pt"}


def shard_header(tensors: Iterable) -> bytes:
    """The 8-byte length and JSON header for these tensors (``name``, ``dtype``, ``shape``, ``nbytes``) in this order,
    padded to 8 bytes."""
    header: dict = {"__metadata__": dict(SHARD_METADATA)}
    offset = 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads with spaces so the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class Writeback:
    """Has the disk start on each range as soon as it is written. Linux writes a file's dirty pages back only once
    the page cache holds some gigabytes of them (the dirty threshold) or they are 30 s old, so after a run that
    writes faster than the disk, a ``sync`` waits for nearly all of it; started at the first byte, the disk works
    while the run does. ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` queues a range's writeback and returns (it keeps
    the pages cached; ``posix_fadvise(DONTNEED)`` would start it too but drop them, and a ``--verify`` reads them
    back); it can still wait for the device's queue, so it runs on a thread of its own and no writer waits on the
    disk. Advisory only: where the call is missing (not Linux) or fails, nothing happens, and no error is raised.
    One run owns one, from one thread (``stream.write_shards``); once closed it starts nothing more."""

    SYNC_FILE_RANGE_WRITE = 2

    def __init__(self):
        self._call = _sync_file_range()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = None

    def open(self, descriptor: int) -> int | None:
        """A descriptor of the same file for this thread to use (closed by :meth:`release`), or None when off."""
        if self._call is None or self._stop.is_set():
            return None
        try:
            own = os.dup(descriptor)
        except OSError:  # out of descriptors: no writeback for this file
            return None
        if self._thread is None:
            try:
                thread = threading.Thread(target=self._run, name="nf4convert-writeback", daemon=True)
                thread.start()
            except RuntimeError:  # no thread to be had: no writeback at all
                os.close(own)
                self._call = None
                return None
            self._thread = thread
        return own

    def request(self, descriptor: int | None, position: int, length: int) -> None:
        if descriptor is not None:
            self._requests.put((descriptor, position, length))

    def release(self, descriptor: int | None) -> None:
        """Close ``descriptor`` once the requests before it have run (at once when stopped)."""
        if descriptor is None:
            return
        if self._thread is None:
            os.close(descriptor)
        else:
            self._requests.put((descriptor, None, None))

    def close(self) -> None:
        """Stop without waiting on the disk: the call running ends, the requests still queued are dropped (their
        ranges are written back as the kernel would anyway; a ``sync`` waits for them). Waiting for every request
        instead made a run's exit wait for the disk (the 8B benchmark: its pipeline done by ~6.3 s, its exit at 11.0)."""
        self._stop.set()
        if self._thread is not None:
            self._requests.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        working = True
        while (request := self._requests.get()) is not None:
            descriptor, position, length = request
            try:
                if position is None:
                    os.close(descriptor)
                elif working and not self._stop.is_set():
                    working = self._call(descriptor, position, length, self.SYNC_FILE_RANGE_WRITE) == 0
            except OSError:  # a close that fails: the descriptor is gone all the same; go on
                pass


def _sync_file_range():
    """libc's ``sync_file_range`` through ctypes (Python's os module has no binding), or None."""
    import sys

    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    call.restype = ctypes.c_int
    return call


class ShardWriter:
    """Writes one shard: the header first, then each tensor's bytes, either appended in header order
    (``write(name, data)``) or put at their planned place (``write(name, data, offset=...)``, from any
    number of threads at once: positional writes)."""

    def __init__(self, path: Path, tensors: list, writeback: Writeback | None = None):
        self.path = path
        self.tensors = tensors
        header = shard_header(tensors)
        self._begin: dict[str, int] = {}
        position = len(header)
        for tensor in tensors:
            self._begin[tensor.name] = position
            position += tensor.nbytes
        self._nbytes = {tensor.name: tensor.nbytes for tensor in tensors}
        self._written = dict.fromkeys(self._begin, 0)
        self._lock = threading.Lock()
        self._next = 0  # the tensor appended to next (header order)
        self._writeback = writeback
        self._flush_descriptor = None
        self._descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            self._flush_descriptor = writeback.open(self._descriptor) if writeback is not None else None
            self._pwrite(header, 0)
        except BaseException:  # not yet the caller's to discard
            self.discard()
            raise

    def _pwrite(self, view, position: int) -> None:
        view = memoryview(view)
        while len(view):  # a regular file takes at most ~2 GiB per call
            done = os.pwrite(self._descriptor, view, position)
            if self._writeback is not None:
                self._writeback.request(self._flush_descriptor, position, done)
            view, position = view[done:], position + done

    def write(self, name: str, data, offset: int | None = None) -> None:
        """Bytes (a contiguous numpy array or CPU tensor, any dtype) of tensor ``name``: appended after the bytes it
        has (call in header order), or at byte ``offset`` of the tensor."""
        import numpy as np

        view = memoryview(np.ascontiguousarray(as_array(data))).cast("B")
        if not len(view) and name in self._begin:
            return  # an empty tensor is complete from the start (appending skips past it)
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
        """Close the file, written or not (the run failed; its folder goes). Once only, even if closing fails."""
        descriptor, self._descriptor = self._descriptor, None
        if descriptor is not None:
            try:
                os.close(descriptor)
            finally:
                if self._writeback is not None:
                    self._writeback.release(self._flush_descriptor)

    def close(self) -> None:
        # No fsync: the folder only gets its final name once every shard is closed, so an
        # interrupted run never looks finished; durability across power loss is the OS's.
        unwritten = [t.name for t in self.tensors if self._written[t.name] != t.nbytes]
        self.discard()
        if unwritten:
            raise RuntimeError(f"{self.path}: closed with {len(unwritten)} tensors unwritten")
