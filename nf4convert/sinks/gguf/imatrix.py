"""An importance matrix as llama-quantize's ``--imatrix FILE`` reads it (common/imatrix-loader.cpp and
tools/quantize/quantize.cpp at the pinned llama.cpp): the GGUF format (``<tensor>.in_sum2`` and ``<tensor>.counts``
per tensor, ``imatrix.datasets``, ``imatrix.chunk_count``, ``imatrix.chunk_size``) or the legacy ``.dat``.

Each entry's weights are what llama-quantize hands the quantizer: GGUF sums divided by each expert's count (rounded
to an integer, then to float32; 1 where the count is 0), legacy sums divided by the entry's call count. The fields
llama-quantize adds to the file: ``quantize.imatrix.file`` (the path as given, at most 127 bytes), ``.dataset`` (the
first dataset, at most 127 bytes), ``.entries_count``, and ``.chunks_count`` where the chunk count is positive.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

from ...errors import ArgumentError

_MAGIC = b"GGUF"
_TEXT_BYTES = 127  # what llama-quantize's override copies of a string (strncpy into 128 bytes)


class Imatrix:
    """The entries of one importance-matrix file (name -> float32 weights), its datasets and chunk count."""

    def __init__(self, path, entries: dict, datasets: list[bytes], chunk_count: int):
        self.path, self.entries, self.datasets, self.chunk_count = path, entries, datasets, chunk_count

    @classmethod
    def read(cls, path) -> "Imatrix":
        """The file at ``path`` (as the user gave it: its text is what the file records).

        Raises:
            ArgumentError: it cannot be read, is neither format, or holds no entry or a value that is not finite.
        """
        try:
            data = Path(path).read_bytes()
        except OSError as error:
            raise ArgumentError(f"{path}: cannot be read ({error.strerror or error})", option="imatrix") from None
        reader = _read_gguf if data[:4] == _MAGIC else _read_legacy
        try:
            entries, datasets, chunk_count = reader(path, data)
        except _Bad as error:
            raise ArgumentError(f"{path}: not an importance matrix llama-quantize reads ({error})", option="imatrix")
        if not entries:
            raise ArgumentError(f"{path}: the importance matrix holds no entries", option="imatrix")
        for name, weights in entries.items():
            if not np.isfinite(weights).all():
                raise ArgumentError(f"{path}: its entry for {name} holds a value that is not finite", option="imatrix")
        return cls(path, entries, datasets, chunk_count)

    def match(self, retyped: dict) -> None:
        """Each tensor of ``retyped`` (name -> ``requant.Retyped``) given its entry's weights.

        Raises:
            ArgumentError: no entry names a tensor of the model, or one has the wrong length for its tensor.
        """
        from .requant import check_imatrix_sizes

        if not any(name in retyped for name in self.entries):
            example = next(iter(self.entries))
            raise ArgumentError(
                f"{self.path}: none of its {len(self.entries)} entries (e.g. {example!r}) names a tensor of this "
                "model: an importance matrix of another model?",
                option="imatrix",
            )
        check_imatrix_sizes(retyped, self.entries, self.path)

    def fields(self, kinds) -> list[tuple[str, object, object]]:
        """(key, value, GGUFValueType) of the metadata llama-quantize adds, in its order."""
        added = [("quantize.imatrix.file", os.fsencode(self.path)[:_TEXT_BYTES].split(b"\0")[0], kinds.STRING)]
        if self.datasets:
            added.append(("quantize.imatrix.dataset", self.datasets[0][:_TEXT_BYTES], kinds.STRING))
        added.append(("quantize.imatrix.entries_count", len(self.entries), kinds.UINT32))
        if self.chunk_count > 0:
            added.append(("quantize.imatrix.chunks_count", self.chunk_count, kinds.UINT32))
        return added


class _Bad(Exception):
    pass


def _read_legacy(path, data: bytes):
    """llama.cpp's legacy ``.dat``: int32 entry count; per entry int32 name length, name, int32 call count, int32
    value count, float32 sums; then optionally int32 chunk count, int32 dataset length, dataset."""
    at = 0

    def take(n: int) -> bytes:
        nonlocal at
        if at + n > len(data) or n < 0:
            raise _Bad("it ends early")
        at += n
        return data[at - n : at]

    def int32() -> int:
        return struct.unpack("<i", take(4))[0]

    count = int32() if len(data) >= 4 else 0
    if count < 1:
        raise _Bad("no entries")
    entries = {}
    for _ in range(count):
        name = take(int32()).split(b"\0")[0].decode("utf-8", "surrogateescape")
        calls, values = int32(), int32()
        if values < 1:
            raise _Bad(f"entry {name!r} has no values")
        sums = np.frombuffer(take(4 * values), dtype="<f4").astype(np.float32)
        with np.errstate(all="ignore"):
            entries[name] = sums / np.float32(calls) if calls > 0 else sums
    datasets, chunk_count = [], 0
    if at < len(data):
        chunk_count = struct.unpack("<i", data[at : at + 4].ljust(4, b"\0"))[0]  # a short read keeps what it read
        at += 4
        if at + 4 <= len(data):
            length = struct.unpack("<i", data[at : at + 4])[0]
            at += 4
            if length > 0 and at + length <= len(data):
                datasets.append(data[at : at + length].split(b"\0")[0])
    return entries, datasets, chunk_count


def _read_gguf(path, data: bytes):
    from .converter import converter

    gguf, _ = converter()
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # noqa: BLE001  (what a broken GGUF makes the reader raise)
        raise _Bad(str(error).splitlines()[0] if str(error) else type(error).__name__) from None
    if not reader.tensors:
        raise _Bad("no entries")
    fields = reader.fields
    keys = ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")
    if not all(key in fields for key in keys):
        raise _Bad(f"its metadata lacks {', '.join(key for key in keys if key not in fields)}")
    datasets = []
    field = fields["imatrix.datasets"]
    kinds = gguf.GGUFValueType
    if field.types[:2] == [kinds.ARRAY, kinds.STRING]:
        datasets = [bytes(field.parts[index]) for index in field.data]
    chunk_count = int(fields["imatrix.chunk_count"].contents())
    pairs: dict[str, list] = {}
    for tensor in reader.tensors:
        for suffix, slot in ((".in_sum2", 0), (".counts", 1)):
            if tensor.name.endswith(suffix) and len(tensor.name) > len(suffix):
                pairs.setdefault(tensor.name[: -len(suffix)], [None, None])[slot] = tensor
    entries = {}
    for name, (sums, counts) in sorted(pairs.items()):
        if sums is None or counts is None:
            raise _Bad(f"{name} has sums without counts or counts without sums")
        if sums.tensor_type != gguf.GGMLQuantizationType.F32 or counts.tensor_type != gguf.GGMLQuantizationType.F32:
            raise _Bad(f"the sums and counts of {name} must be F32")
        values = np.asarray(sums.data, dtype=np.float32).reshape(-1)
        rounded = np.asarray(counts.data, dtype=np.float32).reshape(-1).astype(np.float64)
        rounded = (np.sign(rounded) * np.floor(np.abs(rounded) + 0.5)).astype(np.int64)  # lround
        per_count = values.size // max(rounded.size, 1)
        weights = np.zeros(values.size, dtype=np.float32)  # values past the last whole count stay 0, as in C
        with np.errstate(all="ignore"):
            for index, count in enumerate(rounded):
                part = slice(index * per_count, (index + 1) * per_count)
                weights[part] = values[part] / np.float32(count) if count > 0 else 1
        entries[name] = weights
    return entries, datasets, chunk_count
