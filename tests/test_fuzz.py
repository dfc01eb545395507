"""Seeded fuzzing of what a checkpoint puts in front of nf4convert: headers, indexes, quant-state JSON.

Every case ends in a clean result or one CheckpointError line, never another exception, a hang or a
half-written output. The headers are also checked against safetensors' own reader: nothing it refuses is
accepted, what both accept reads the same, and what only it accepts is refused for a reason this project
chose to be stricter about. A failing case prints its seed and its mutations; ``fuzz_header``, ``fuzz_index``
and ``fuzz_cli`` rebuild a case from its seed alone (plain ``random.Random(seed)``), so it can be replayed.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import struct
import traceback
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nf4convert.errors import CheckpointError
from nf4convert.safetensors_io.read import read_tensors

from fixtures.safetensors_files import join, our_reads, random_tensors, retile, safetensors_reads, split

HEADER_CASES = 3000
INDEX_CASES = 1000
CLI_CASES = 300
EXAMPLE = Path(__file__).parent.parent / "examples" / "tiny-llama-bnb-4bit"

# Where this project refuses a file that safetensors takes, on purpose (see checkpoint.py).
STRICTER_THAN_SAFETENSORS = (
    "appears twice",
    "header entry must have exactly",
    "unknown dtype",
    "is empty or has control characters",
)
SAFETENSORS_DTYPES = [
    "BOOL",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
]
ODD_VALUES = [
    None,
    True,
    False,
    0,
    1,
    -1,
    3,
    64,
    2**31,
    2**63,
    2**64,
    10**30,
    0.5,
    64.0,
    -0.0,
    1e308,
    "",
    "x",
    "F32",
    [],
    [1],
    [2, 3],
    [-1],
    [1.5],
    [True],
    {},
    {"a": 1},
    "\u202e",
    "a\nb",
]
ODD_NAMES = ["", "a\nb", "tab\tname", "\u2028", "名前.weight", "x" * 3000, "__metadata__", " ", "model.ids"]


def _one_line_error(message: str, *prefixes: str) -> None:
    assert "\n" not in message and "\r" not in message, f"message spans lines: {message!r}"
    assert message.startswith(prefixes), f"message does not start with the file: {message!r}"


def _json_number_spans(raw: bytes) -> list[tuple[int, int]]:
    spans, position = [], 0
    while position < len(raw):
        if raw[position : position + 1].isdigit() and raw[position - 1 : position] not in (b'"',):
            end = position
            while end < len(raw) and raw[end : end + 1].isdigit():
                end += 1
            spans.append((position, end))
            position = end
        position += 1
    return spans


def mutate_json_bytes(rng: random.Random, raw: bytes, log: list) -> bytes:
    """One byte-level change of a JSON text: what a bit flip, a bad editor or a hostile writer makes of it."""
    choice = rng.randrange(9)
    if choice == 0 and raw:
        position = rng.randrange(len(raw))
        byte = rng.choice([rng.randrange(256), *b'{}[]",:0-.e \\'])
        log.append(f"byte {position} -> {byte}")
        return raw[:position] + bytes([byte]) + raw[position + 1 :]
    if choice == 1 and raw:
        start = rng.randrange(len(raw))
        end = min(len(raw), start + rng.randrange(1, 12))
        log.append(f"delete bytes {start}:{end}")
        return raw[:start] + raw[end:]
    if choice == 2:
        position = rng.randrange(len(raw) + 1)
        insert = rng.choice(
            [b"\xff", b"\xc3", b"\x00", b",", b"{", b"]", b'"', b"\\u", b"NaN", b"-", b" " * 9, b"\xe2\x80\xa8"]
        )
        log.append(f"insert {insert!r} at {position}")
        return raw[:position] + insert + raw[position:]
    if choice == 3:
        depth = rng.choice([50, 1000, 100_000])
        log.append(f"nest {depth} deep")
        opener, closer = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
        inner = opener * depth + b"1" + closer * depth
        return inner if rng.random() < 0.5 else raw.replace(b'"pt"', inner, 1)
    spans = _json_number_spans(raw)
    if choice == 4 and spans:
        start, end = rng.choice(spans)
        number = rng.choice(
            [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"7" * 5000, b"-0", b"1.0", b"true", b"18446744073709551616"]
        )
        log.append(f"number at {start} -> {number[:20]!r}")
        return raw[:start] + number + raw[end:]
    if choice == 5:
        log.append("truncate JSON")
        return raw[: rng.randrange(len(raw) + 1)]
    if choice == 6:
        log.append("pad with whitespace")
        return raw + b" " * rng.randrange(1, 9)
    if choice == 7 and raw.endswith(b"}"):
        try:
            parsed = json.loads(raw)
        except (ValueError, RecursionError):  # an earlier mutation broke it already
            parsed = None
        if isinstance(parsed, dict) and parsed:
            key = rng.choice(sorted(parsed))
            log.append(f"duplicate key {key!r}")
            return raw[:-1] + b"," + json.dumps({key: parsed[key]})[1:].encode()
    log.append("no change")
    return raw


# ---- (a) safetensors headers through read_header, against safetensors' own reader ----------------------


def _base_files() -> list[tuple[dict, bytes]]:
    bases = []
    for seed in range(3):
        tensors = random_tensors(100 + seed)
        generator = torch.Generator().manual_seed(seed)
        tensors[f"extra.{seed}.f8"] = torch.randn(seed + 3, generator=generator).to(torch.float8_e4m3fn)
        tensors[f"extra.{seed}.empty"] = torch.empty(0, seed + 1, dtype=torch.float16)
        tensors[f"extra.{seed}.u16"] = torch.randint(1, 60000, (5, 3), generator=generator, dtype=torch.int32).to(
            torch.uint16
        )
        from safetensors.torch import save

        bases.append(split(save(tensors, metadata={"format": "pt", "seed": str(seed)})))
    return bases


def _tensor_names(header: dict) -> list[str]:
    return sorted(k for k in header if k != "__metadata__" and isinstance(header[k], dict))


def mutate_header(rng: random.Random, header: dict, data: bytes, log: list) -> tuple[dict, bytes]:
    names = _tensor_names(header)
    name = rng.choice(names) if names else None
    entry = header.get(name) if name else None
    choice = rng.randrange(12)
    if choice == 0 and name:
        log.append(f"delete {name}")
        del header[name]
    elif choice == 1 and len(names) > 1:
        other = rng.choice(names)
        log.append(f"swap offsets {name} <-> {other}")
        header[name]["data_offsets"], header[other]["data_offsets"] = (
            header[other]["data_offsets"],
            header[name]["data_offsets"],
        )
    elif choice == 2 and entry:
        side = rng.randrange(2)
        value = rng.choice(
            [
                entry["data_offsets"][side] + rng.randint(-8, 8),
                -1,
                2**64,
                2**63,
                len(data) + 1,
                0,
                1.0 * entry["data_offsets"][side],
            ]
        )
        log.append(f"{name} offset[{side}] -> {value}")
        entry["data_offsets"][side] = value
    elif choice == 3 and entry:
        value = rng.choice([*SAFETENSORS_DTYPES, "X", "", "f32", 5, None, ["F32"]])
        log.append(f"{name} dtype -> {value!r}")
        entry["dtype"] = value
    elif choice == 4 and entry:
        shape = list(entry["shape"])
        how = rng.randrange(6)
        if how == 0:
            shape.append(rng.choice([1, 2, 0, 3]))
        elif how == 1 and shape:
            shape.pop(rng.randrange(len(shape)))
        elif how == 2 and shape:
            shape[rng.randrange(len(shape))] = rng.choice(ODD_VALUES)
        elif how == 3:
            shape = rng.choice([None, "3", 3, {"a": 1}, [2**32, 2**32], [2**62, 8], [1] * 1000])
        elif how == 4 and shape:
            index = rng.randrange(len(shape))
            shape[index] += rng.choice([-1, 1])
        else:
            shape = list(reversed(shape))  # same size: still valid
        log.append(f"{name} shape -> {str(shape)[:40]}")
        entry["shape"] = shape
    elif choice == 5 and entry:
        if rng.random() < 0.5:
            key = rng.choice(["extra", "dtype2", "offsets", ""])
            log.append(f"{name} gains key {key!r}")
            entry[key] = rng.choice(ODD_VALUES)
        else:
            key = rng.choice(sorted(entry))
            log.append(f"{name} loses key {key!r}")
            del entry[key]
    elif choice == 6 and name:
        value = rng.choice(ODD_VALUES)
        log.append(f"{name} entry -> {str(value)[:20]!r}")
        header[name] = value
    elif choice == 7:
        value = rng.choice(
            [None, {}, {"a": 1}, ["x"], "pt", {"format": "pt", "k": "v"}, {"k": None}, {"\ud800": "x"}, {"k": "\udc00"}]
        )
        log.append(f"metadata -> {value!r}")
        header["__metadata__"] = value
    elif choice == 8 and name:
        new = rng.choice(ODD_NAMES)
        log.append(f"rename {name} -> {new[:20]!r}")
        header[new] = header.pop(name)
    elif choice == 9 and names:
        order = names[:]
        rng.shuffle(order)
        log.append(f"retile in order {order}")  # valid: the data follows the new layout
        header, data = retile(header, data, order)
        if rng.random() < 0.5:
            header = dict(reversed(list(header.items())))
    elif choice == 10:
        fresh = f"added.{rng.randrange(100)}"
        size = rng.randrange(0, 9)
        log.append(f"append tensor {fresh} of {size} bytes")  # valid
        header[fresh] = {"dtype": "U8", "shape": [size], "data_offsets": [len(data), len(data) + size]}
        data += bytes(rng.randrange(1, 256) for _ in range(size))
    elif choice == 11 and data:
        position = rng.randrange(len(data))
        log.append(f"data byte {position} changed")  # valid: both readers see the new byte
        data = data[:position] + bytes([(data[position] + 1) % 256]) + data[position + 1 :]
    return header, data


def mutate_file(rng: random.Random, raw: bytes, log: list) -> bytes:
    choice = rng.randrange(5)
    (length,) = struct.unpack("<Q", raw[:8])
    if choice == 0:
        value = rng.choice(
            [length + rng.randint(-9, 9), 0, 2**64 - 1, 100_000_001, 100_000_000, rng.randrange(2**64), len(raw)]
        )
        log.append(f"length prefix -> {value}")
        return struct.pack("<Q", max(0, min(value, 2**64 - 1))) + raw[8:]
    if choice == 1:
        position = rng.randrange(8)
        log.append(f"prefix byte {position} flipped")
        return raw[:position] + bytes([raw[position] ^ (1 << rng.randrange(8))]) + raw[position + 1 :]
    if choice == 2:
        cut = rng.randrange(len(raw))
        log.append(f"truncate file at {cut}")
        return raw[:cut]
    if choice == 3:
        extra = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 20)))
        log.append(f"append {len(extra)} bytes")
        return raw + extra
    log.append("file unchanged")
    return raw


def fuzz_header(seed: int, bases, path: Path) -> str | None:
    """Run one header case; None if it ends as it should, else a description of what went wrong."""
    rng = random.Random(seed)
    header, data = json.loads(json.dumps(bases[seed % len(bases)][0])), bases[seed % len(bases)][1]
    log: list[str] = []
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        try:  # a change that assumes a well-formed entry is skipped where an earlier one broke it
            header, data = mutate_header(rng, json.loads(json.dumps(header)), data, log)
        except (TypeError, KeyError, IndexError, AttributeError, ValueError):
            log.append("(skipped)")
    raw_json = json.dumps(header).encode()
    for _ in range(rng.choice([0, 0, 0, 1, 2])):
        raw_json = mutate_json_bytes(rng, raw_json, log)
    raw = join(raw_json, data)
    for _ in range(rng.choice([0, 0, 0, 1])):
        raw = mutate_file(rng, raw, log)
    path.write_bytes(raw)
    where = f"seed {seed} ({'; '.join(log) or 'unchanged'})"
    try:
        ours = our_reads(path)
    except CheckpointError as error:
        ours = error
    except Exception:  # noqa: BLE001  (the point: no other exception may escape)
        return f"{where}: {traceback.format_exc(limit=-3)}"
    theirs = safetensors_reads(path)
    if isinstance(ours, CheckpointError):
        try:
            _one_line_error(str(ours), f"{path}: ")
        except AssertionError as error:
            return f"{where}: {error}"
        if theirs is not None and not any(reason in str(ours) for reason in STRICTER_THAN_SAFETENSORS):
            return f"{where}: safetensors reads it, we refuse: {ours}"
        return None
    if theirs is None:
        return f"{where}: we read it, safetensors refuses it"
    if ours != theirs:
        return f"{where}: we read {ours}, safetensors reads {theirs}"
    return None


def test_fuzz_headers(tmp_path):
    bases = _base_files()
    failures = [f for seed in range(HEADER_CASES) if (f := fuzz_header(seed, bases, tmp_path / "model.safetensors"))]
    assert not failures, f"{len(failures)} of {HEADER_CASES} header cases went wrong:\n" + "\n".join(failures[:10])


# ---- (b) index files (and links) through read_tensors ------------------------------------------------


@pytest.fixture(scope="module")
def index_world(tmp_path_factory):
    """A sharded checkpoint, and, beside it, files a hostile index would like to be read."""
    root = tmp_path_factory.mktemp("index-world")
    folder = root / "ckpt"
    folder.mkdir()
    tensors = random_tensors(21)
    names = sorted(tensors)
    weight_map = {}
    for index, part in enumerate((names[:2], names[2:]), 1):
        filename = f"model-{index:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, folder / filename)
        weight_map.update(dict.fromkeys(part, filename))
    (folder / "config.json").write_text("{}")
    (folder / "sub").mkdir()
    save_file({"secret": torch.arange(1, 9, dtype=torch.int64)}, root / "outside.safetensors")
    (root / "ckpt-evil").mkdir()
    save_file({"secret": torch.arange(1, 5, dtype=torch.int32)}, root / "ckpt-evil" / "model.safetensors")
    return folder, weight_map


def _file_names(folder: Path) -> list:
    outside = folder.parent / "outside.safetensors"
    return [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "../outside.safetensors",
        str(outside),
        "sub/../../outside.safetensors",
        "./model-00001-of-00002.safetensors",
        "sub//x.safetensors",
        "..\\outside.safetensors",
        "C:/outside.safetensors",
        "",
        "config.json",
        "missing.safetensors",
        "sub",
        "sub/",
        "link.safetensors",
        "/dev/zero",
        "\x00.safetensors",
        "a\nb.safetensors",
        "%2e%2e/outside.safetensors",
        "../ckpt-evil/model.safetensors",
        "~/x.safetensors",
        "sub/link.safetensors",
        "ckpt/../outside.safetensors",
        1,
        None,
        ["x"],
        {"a": 1},
        True,
    ]


def fuzz_index(seed: int, folder: Path, base_map: dict) -> str | None:
    rng = random.Random(seed)
    log: list[str] = []
    weight_map: dict = dict(base_map)
    files = _file_names(folder)
    index: object = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    for _ in range(rng.choice([1, 1, 2, 3])):
        choice = rng.randrange(6)
        if choice == 0 and weight_map:
            name = rng.choice(sorted(weight_map))
            weight_map[name] = rng.choice(files)
            log.append(f"{name} -> {str(weight_map[name])[:40]!r}")
        elif choice == 1:
            weight_map["secret"] = rng.choice(files)
            log.append(f"secret -> {str(weight_map['secret'])[:40]!r}")
        elif choice == 2 and weight_map:
            name = rng.choice(sorted(weight_map))
            new = rng.choice(ODD_NAMES)
            weight_map[new] = weight_map.pop(name)
            log.append(f"rename {name} -> {new[:20]!r}")
        elif choice == 3 and weight_map:
            name = rng.choice(sorted(weight_map))
            del weight_map[name]
            log.append(f"delete {name}")
        elif choice == 4:
            index = rng.choice(
                [
                    [weight_map],
                    {"weight_map": list(weight_map.items())},
                    {"weight_map": None},
                    {"metadata": {}},
                    {"weight_map": weight_map, "metadata": rng.choice(ODD_VALUES)},
                    7,
                    "weight_map",
                ]
            )
            log.append(f"index -> {str(index)[:40]}")
        else:
            target = rng.choice(
                [
                    folder.parent / "outside.safetensors",
                    "model-00002-of-00002.safetensors",
                    "link.safetensors",
                    "sub",
                    "missing",
                    "/dev/null",
                    folder.parent / "ckpt-evil" / "model.safetensors",
                ]
            )
            where = rng.choice(["link.safetensors", "sub/link.safetensors"])
            if os.path.lexists(folder / where):
                continue
            os.symlink(target, folder / where)
            log.append(f"{where} links to {target}")
            if rng.random() < 0.5:
                weight_map[rng.choice(["secret", *sorted(base_map)])] = where
    raw = json.dumps(index).encode()
    if rng.random() < 0.3:
        raw = mutate_json_bytes(rng, raw, log)
    if rng.random() < 0.05:
        log.append("no index")
        index = None
    else:
        (folder / "model.safetensors.index.json").write_bytes(raw)
    description = f"seed {seed} ({'; '.join(log)})"
    try:
        tensors = read_tensors(folder)
    except CheckpointError as error:
        try:
            _one_line_error(str(error), str(folder))
        except AssertionError as problem:
            return f"{description}: {problem}"
        return None
    except Exception:  # noqa: BLE001
        return f"{description}: {traceback.format_exc(limit=-3)}"
    finally:
        for leftover in ("link.safetensors", "sub/link.safetensors", "model.safetensors.index.json"):
            if os.path.lexists(folder / leftover):
                os.unlink(folder / leftover)
    shards = {os.path.realpath(folder / f) for f in set(base_map.values())}
    if "secret" in tensors or any(os.path.realpath(info.path) not in shards for info in tensors.values()):
        return f"{description}: read a file outside the checkpoint: {sorted({str(i.path) for i in tensors.values()})}"
    if (
        isinstance(index, dict)
        and isinstance(index.get("weight_map"), dict)
        and not set(index["weight_map"]) <= set(tensors)
    ):
        return f"{description}: accepted an index naming tensors it did not find"
    return None


def test_fuzz_indexes(index_world):
    folder, weight_map = index_world
    failures = [f for seed in range(INDEX_CASES) if (f := fuzz_index(seed, folder, weight_map))]
    assert not failures, f"{len(failures)} of {INDEX_CASES} index cases went wrong:\n" + "\n".join(failures[:10])


# ---- (c) quant-state JSON through the whole CLI ------------------------------------------------------


QUANT_KEYS = ["quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset"]
QUANT_VALUES = [
    *ODD_VALUES,
    "nf4",
    "fp4",
    "NF4",
    " nf4",
    "bfloat16",
    "float16",
    "float32",
    "int8",
    32,
    128,
    4096,
    256,
    48,
    [256, 688],
    [688, 256],
    [176128],
    [1, 176128],
    [256.0, 688],
    [True, 688],
    [[256]],
    float("nan"),
    float("inf"),
    10**400,
    -(10**400),
]


def mutate_quant_state(rng: random.Random, meta: dict, log: list) -> dict:
    choice = rng.randrange(5)
    if choice == 0 and meta:
        key = rng.choice(sorted(meta))
        del meta[key]
        log.append(f"delete {key}")
    elif choice in (1, 2):
        key = rng.choice([*QUANT_KEYS, "extra"])
        meta[key] = rng.choice(QUANT_VALUES)
        log.append(f"{key} -> {meta[key]!r}")
    elif choice == 3:
        # Changes that keep the checkpoint valid: the output must then verify.
        # Changes that keep the same numbers in other spellings (a float or bool where an int stands) or that
        # keep the checkpoint valid: either way the output, if any, must then verify.
        how = rng.randrange(5)
        n = 1
        for dim in meta.get("shape", []) if isinstance(meta.get("shape"), list) else []:
            n *= dim if isinstance(dim, int) else 1
        if how == 0 and n > 1:
            divisors = [d for d in range(1, 65) if n % d == 0]
            divisor = rng.choice(divisors)
            meta["shape"] = rng.choice(
                [[n // divisor, divisor], [n // divisor, True, divisor], [float(n // divisor), divisor]]
            )
        elif how == 1:
            meta["dtype"] = rng.choice(["float16", "float32", "bfloat16"])
        elif how == 2:
            key = rng.choice(["blocksize", "nested_blocksize"])
            if isinstance(meta.get(key), int):
                meta[key] = float(meta[key])
        else:
            meta["nested_offset"] = rng.uniform(-1, 1)
        log.append(f"same or valid -> {meta}")
    else:
        meta = dict(reversed(list(meta.items())))
        log.append("reorder keys")
    return meta


@pytest.fixture(scope="module")
def quant_world(tmp_path_factory):
    """The example checkpoint's tensors (name -> (dtype, shape, bytes)), its 4-bit weights and config.json."""
    pytest.importorskip("bitsandbytes")
    from fixtures.safetensors_files import TORCH_DTYPES

    tensors = {}
    for path in sorted(EXAMPLE.glob("*.safetensors")):
        header, data = split(path.read_bytes())
        for name in _tensor_names(header):
            begin, end = header[name]["data_offsets"]
            tensors[name] = (header[name]["dtype"], header[name]["shape"], data[begin:end])
    assert {dtype for dtype, _, _ in tensors.values()} <= set(TORCH_DTYPES)
    weights = sorted(k.split(".quant_state.")[0] for k in tensors if ".quant_state.bitsandbytes__" in k)
    return tmp_path_factory.mktemp("cli-world"), tensors, weights, (EXAMPLE / "config.json").read_text()


def _checkpoint(folder: Path, world, weight: str, other: str, content: bytes) -> None:
    """A small real 4-bit checkpoint cut from the example: ``weight`` (its quant-state JSON replaced by
    ``content``, and in the second shard, as a sharded save can leave it), ``other`` intact, two plain tensors."""
    _, tensors, _, config = world
    state_key = f"{weight}.quant_state.bitsandbytes__nf4"
    first = [k for k in tensors if (k.startswith(weight + ".") or k == weight) and k != state_key]
    first += [k for k in tensors if k.startswith(other + ".") or k == other]
    first.append("model.norm.weight")
    second = [state_key, "model.layers.0.input_layernorm.weight"]
    folder.mkdir()
    weight_map = {}
    for index, names in enumerate((first, second), 1):
        header, chunks, position = {"__metadata__": {"format": "pt"}}, [], 0
        for name in names:
            dtype, shape, data = tensors[name]
            if name == state_key:
                data, shape = content, [len(content)]
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + len(data)]}
            position += len(data)
            chunks.append(data)
        filename = f"model-{index:05d}-of-00002.safetensors"
        (folder / filename).write_bytes(join(header, b"".join(chunks)))
        weight_map.update(dict.fromkeys(names, filename))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(config)


def _cli(*args):
    from click.testing import CliRunner

    from nf4convert.cli.commands import main

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


def _crash(result) -> str | None:
    """'<exception> in <file>:<function>' (the innermost nf4convert frame) if the command raised, else None."""
    if isinstance(result.exception, (SystemExit, type(None))):
        return None
    frames = [
        f for f in traceback.extract_tb(result.exc_info[2]) if "nf4convert" in f.filename and "tests" not in f.filename
    ]
    site = f"{Path(frames[-1].filename).name}:{frames[-1].name}" if frames else "?"
    return f"{type(result.exception).__name__} in {site}"


def run_cli_case(world, weight: str, other: str, content: bytes, tag: str) -> tuple[str, str] | None:
    """Convert a checkpoint whose ``weight`` has quant-state JSON ``content``, and verify what it writes.

    None if it ends as it should; else (where it went wrong, what happened): a crash site such as
    'convert: TypeError in quant_state.py:check_quant_state_meta', or a broken promise.
    """
    root = world[0]
    case, out = root / f"case-{tag}", root / f"out-{tag}"
    _checkpoint(case, world, weight, other, content)
    try:
        result = _cli(case, "-o", out, "-q", "--device", "cpu")
        if crash := _crash(result):
            return f"convert: {crash}", repr(result.exception)[:200]
        if leftovers := [p.name for p in root.iterdir() if "nf4convert" in p.name]:
            return "convert: left files behind", str(leftovers)
        lines = [line for line in result.output.splitlines() if line.strip()]
        if result.exit_code == 0:
            if not (out / "model.safetensors").exists():
                return "convert: exit 0 without an output", result.output[-200:]
            verified = _cli("verify", out, case, "-q", "--device", "cpu")
            if crash := _crash(verified):
                return f"verify: {crash}", repr(verified.exception)[:200]
            if verified.exit_code != 0 or "OK: bit-exact" not in verified.output:
                found = [line for line in verified.output.splitlines() if line.startswith("  MISMATCH")]
                # a recorded shape the model does not load: convert writes what the state records, verify names it;
                # and the model's parameters that these cut-down checkpoints lack, which verify names too
                named = ("transformers' model loads", "the source and the output lack it")
                if verified.exit_code == 1 and found and all(any(n in line for n in named) for line in found):
                    return None
                return "verify: refuses what convert wrote", verified.output[-300:]
            return None
        if (
            result.exit_code != 1
            or len(lines) != 1
            or not lines[0].startswith("Error: ")
            or "Traceback" in result.output
        ):
            return "convert: not one error line", f"exit {result.exit_code}: {result.output[-300:]!r}"
        if out.exists():
            return "convert: an output folder was left after an error", str(out)
        return None
    finally:
        shutil.rmtree(case, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


def fuzz_cli(seed: int, world) -> tuple[tuple[str, str] | None, str, bytes]:
    rng = random.Random(seed)
    _, tensors, weights, _ = world
    weight, other = rng.sample(weights, 2)
    log: list[str] = [weight]
    meta = json.loads(tensors[f"{weight}.quant_state.bitsandbytes__nf4"][2])
    for _ in range(rng.choice([1, 1, 2])):
        meta = mutate_quant_state(rng, meta, log)
    content = json.dumps(meta).encode()
    if rng.random() < 0.25:
        content = mutate_json_bytes(rng, content, log)
    description = f"seed {seed} ({'; '.join(log)}): quant state {content[:200]!r}"
    return run_cli_case(world, weight, other, content, str(seed)), description, content


# Failures the fuzzer once found in the quant-state checks (all fixed in formats/bnb4.py's parse_meta): each a
# minimal reproducer (the quant-state JSON of the 256x256 q_proj weight of layer 0 in the checkpoint _checkpoint
# cuts from examples/tiny-llama-bnb-4bit), where it used to go wrong, and the pattern that triggered it. Each must
# now end cleanly (test_former_cli_bug); replay one alone: ``run_cli_case(world, weight, other, content, "x")``.
_Q = b'"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [256, 256], '
_NESTED = b'"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.0522'
KNOWN_BUGS: dict[str, tuple[str, bytes, bytes]] = {  # name: (site, reproducer, trigger pattern)
    # check_quant_state_meta looks a list up in a dict: `meta["dtype"] not in OUT_DTYPES` raises TypeError.
    "unhashable-quant-type-or-dtype": (
        "convert: TypeError in quant_state.py:check_quant_state_meta",
        b'{"quant_type": "nf4", "blocksize": 64, "dtype": ["bfloat16"], "shape": [256, 256], ' + _NESTED + b"}",
        rb'"(quant_type|dtype)": *[\[{]',
    ),
    # json.loads of the quant state raises RecursionError, which plan.py does not catch.
    "deeply-nested-json": (
        "convert: RecursionError in plan.py:_quant_groups",
        b"[" * 5000 + b"]" * 5000,
        rb"(\[|\{\"a\": ?){100}",
    ),
    # float(nested_offset) of an integer beyond float range: OverflowError.
    "offset-beyond-float": (
        "convert: OverflowError in quant_state.py:build_quant_state",
        b"{" + _Q + b'"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 1' + b"0" * 400 + b"}",
        rb'"nested_offset": *-?\d{300,}',
    ),
    # A bool passes `isinstance(d, int)`: the output header then says "shape": [true, 65536], which no reader takes.
    "bool-in-shape": (
        "verify: refuses what convert wrote",
        b'{"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [true, 65536], ' + _NESTED + b"}",
        rb'"shape": *\[[^\]]*(true|false)',
    ),
    # A nested_offset that is not finite in fp32 (NaN, Infinity: plan.py's json.loads allows them; 1e308; 7...7.05)
    # passes the numeric check; the weight then holds NaN/inf whose bits differ from bitsandbytes' on the CPU.
    "offset-not-finite-in-fp32": (
        "verify: refuses what convert wrote",
        b"{" + _Q + b'"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": NaN}',
        rb'"nested_offset": *-?(NaN|Infinity|\d{39}|[\d.]+[eE]\+?(39|[4-9]\d|\d{3}))',
    ),
    # nested_dtype is ignored by convert (absmax is always rebuilt in fp32); bitsandbytes rebuilds it in that dtype.
    "nested-dtype-ignored": (
        "verify: refuses what convert wrote",
        b"{" + _Q + b'"nested_blocksize": 256, "nested_dtype": "float16", "nested_offset": 0.0522}',
        rb'"nested_dtype": *"(?!float32")',
    ),
    # convert takes a quant state that bitsandbytes' QuantState.from_dict cannot load, and verify does not catch it:
    "nested-dtype-missing": (
        "verify: KeyError in verify.py:_bnb_state",
        b"{" + _Q + b'"nested_blocksize": 256, "nested_offset": 0.0522}',
        rb'(?s)^(?!.*"nested_dtype").*"nested_blocksize"',
    ),
    "nested-dtype-not-a-string": (
        "verify: TypeError in verify.py:_bnb_state",
        b"{" + _Q + b'"nested_blocksize": 256, "nested_dtype": 32, "nested_offset": 0.0522}',
        rb'"nested_dtype": *[^"\s]',
    ),
    "nested-dtype-unknown": (
        "verify: AttributeError in verify.py:_bnb_state",
        b"{" + _Q + b'"nested_blocksize": 256, "nested_dtype": "f32", "nested_offset": 0.0522}',
        rb'"nested_dtype": *"(?!float32")',
    ),
    "unknown-key": (
        "verify: AssertionError in verify.py:_bnb_state",
        b"{" + _Q + _NESTED + b', "extra": 1}',
        rb'"(?!(quant_type|blocksize|dtype|shape|nested_blocksize|nested_dtype|nested_offset)")[^"]*": ',
    ),
    # blocksize 64.0 passes `in BLOCKSIZES`; bitsandbytes' op then refuses a float blocksize.
    "float-blocksize": (
        "verify: RuntimeError in verify.py:_reference",
        b'{"quant_type": "nf4", "blocksize": 64.0, "dtype": "bfloat16", "shape": [256, 256], ' + _NESTED + b"}",
        rb'"blocksize": *\d+\.\d',
    ),
}


def test_fuzz_cli(quant_world):
    failures = []
    for seed in range(CLI_CASES):
        problem, description, content = fuzz_cli(seed, quant_world)
        if problem is not None:
            failures.append(f"{description}\n    -> {problem[0]}: {problem[1]}")
    assert not failures, f"{len(failures)} of {CLI_CASES} CLI cases went wrong:\n" + "\n".join(failures[:10])


@pytest.mark.parametrize("bug", sorted(KNOWN_BUGS))
def test_former_cli_bug(bug, quant_world):
    site, content, pattern = KNOWN_BUGS[bug]
    assert re.search(pattern, content), f"{bug}: the reproducer does not match its own trigger pattern"
    weights = quant_world[2]
    weight = next(w for w in weights if w.endswith("layers.0.self_attn.q_proj.weight"))
    problem = run_cli_case(quant_world, weight, weights[0], content, f"former-{bug}")
    assert problem is None, f"{bug} (once {site}): {problem}"
