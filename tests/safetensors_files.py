"""Small safetensors files for the reading tests: build, take apart, and read with safetensors' own reader."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

# safetensors dtype names -> torch dtypes, for every dtype nf4convert reads (kept here, not imported, so the
# tests do not depend on how the package lays out its table).
TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def random_tensors(seed: int) -> dict[str, torch.Tensor]:
    """A few tensors of odd shapes and several dtypes (never zeros), named like a model's."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.embed.weight": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        "model.norm.weight": torch.randn(13, generator=generator),
        "model.ids": torch.randint(1, 1000, (3, 3), generator=generator, dtype=torch.int64),
        "model.layer.weight": torch.randint(1, 255, (11,), generator=generator, dtype=torch.uint8),
    }


def split(raw: bytes) -> tuple[dict, bytes]:
    """(header dict, data bytes) of a well-formed file."""
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def join(header: dict | bytes, data: bytes) -> bytes:
    """A file from a header (a dict, or the JSON bytes as they should stand) and the data after it."""
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def safetensors_reads(path: Path) -> tuple[dict, dict] | None:
    """What safetensors' own reader makes of a file: ({name: (dtype, shape, bytes)}, metadata), or None if refused."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as file:
            tensors = {}
            for name in file.keys():  # noqa: SIM118  (safe_open is not a mapping)
                tensor = file.get_tensor(name)
                code = next(code for code, dtype in TORCH_DTYPES.items() if dtype == tensor.dtype)
                tensors[name] = (code, tuple(tensor.shape), tensor_bytes(tensor))
            return tensors, file.metadata() or {}
    except Exception:  # noqa: BLE001  (any refusal of safetensors' is the answer wanted)
        return None


def our_reads(path: Path) -> tuple[dict, dict]:
    """The same through nf4convert's read_header and TensorReader."""
    from nf4convert.safetensors_io.read import TensorReader, read_header

    tensors, metadata = read_header(path)
    reader = TensorReader()
    try:
        return {
            name: (info.dtype, info.shape, bytes(reader.read(info).numpy())) for name, info in tensors.items()
        }, metadata
    finally:
        reader.close()


def retile(header: dict, data: bytes, order: list[str]) -> tuple[dict, bytes]:
    """Rewrite the data so the tensors sit in ``order`` (a valid file whose header lists them out of order)."""
    chunks = {name: data[header[name]["data_offsets"][0] : header[name]["data_offsets"][1]] for name in order}
    position, out = 0, b""
    for name in order:
        header[name]["data_offsets"] = [position, position + len(chunks[name])]
        position += len(chunks[name])
        out += chunks[name]
    return header, out
