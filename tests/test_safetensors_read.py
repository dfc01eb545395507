"""Strict reading of safetensors headers and indexes, and no reads outside the checkpoint folder.

Each header rule is checked on a small file written by safetensors itself and then edited; each case also
records whether safetensors' own ``safe_open`` takes the edited file, so the claim "as strict as safetensors,
stricter only where said" is tested, not assumed.
"""

from __future__ import annotations

import collections
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nf4convert.errors import CheckpointError
from nf4convert.safetensors_io.read import TensorReader, read_header, read_index, read_tensors
from nf4convert.safetensors_io.write import ShardWriter, shard_header

from fixtures.safetensors_files import (
    TORCH_DTYPES,
    join,
    our_reads,
    random_tensors,
    retile,
    safetensors_reads,
    split,
    tensor_bytes,
)


@pytest.fixture
def shard(tmp_path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file(random_tensors(11), path, metadata={"format": "pt"})
    return path


def test_a_valid_file_reads_as_safetensors_reads_it(shard):
    assert our_reads(shard) == safetensors_reads(shard)
    assert our_reads(shard)[1] == {"format": "pt"}


def _edit_entry(name, **changes):
    def edit(header, data):
        header[name].update(changes)
        return header, data

    return edit


def _first(header) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _last(header) -> str:
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


# (case, edit(header dict, data) -> (header dict or raw JSON bytes, data) or a whole file's bytes,
#  words the message must hold, tensor the message must name or None, whether safetensors takes the file)
HEADER_CASES = [
    ("shorter-than-8", lambda h, d: b"\x01\x00", "shorter than its 8-byte header length", None, False),
    (
        "length-over-limit",
        lambda h, d: struct.pack("<Q", 100_000_001) + b"{}",
        "corrupt or truncated safetensors header",
        None,
        False,
    ),
    (
        "length-past-eof",
        lambda h, d: struct.pack("<Q", 1000) + b"{}",
        "corrupt or truncated safetensors header",
        None,
        False,
    ),
    ("not-utf8", lambda h, d: (b'{"a\xff":1}', d), "not UTF-8", None, False),
    ("not-json", lambda h, d: (b"{not json}", d), "not JSON", None, False),
    ("bom", lambda h, d: (b"\xef\xbb\xbf{}", b""), "not JSON", None, False),
    ("trailing-junk", lambda h, d: (json.dumps(h).encode() + b"}", d), "not JSON", None, False),
    ("array", lambda h, d: (b"[]", b""), "not a JSON object", None, False),
    ("deep-nesting", lambda h, d: (b"[" * 100_000 + b"]" * 100_000, b""), "nested too deeply", None, False),
    ("deep-objects", lambda h, d: (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b""), "nested too deeply", None, False),
    ("nan", lambda h, d: (json.dumps(h).replace('"pt"', "NaN").encode(), d), "NaN is not JSON", None, False),
    (
        "infinity",
        lambda h, d: (json.dumps(h).replace("[13]", "[Infinity]").encode(), d),
        "Infinity is not JSON",
        None,
        False,
    ),
    (
        "huge-integer",
        lambda h, d: (json.dumps(h).replace("[13]", "[" + "7" * 5000 + "]").encode(), d),
        "not JSON that can be read",
        None,
        False,
    ),
    (
        "duplicate-tensor",
        lambda h, d: (json.dumps(h)[:-1].encode() + b',"model.ids":' + json.dumps(h["model.ids"]).encode() + b"}", d),
        "key 'model.ids' appears twice",
        None,
        True,
    ),
    (
        "duplicate-field",
        lambda h, d: (json.dumps(h).replace('"dtype": "F32"', '"dtype": "F32", "dtype": "F16"').encode(), d),
        "key 'dtype' appears twice",
        None,
        False,
    ),
    (
        "entry-not-object",
        lambda h, d: ({**h, "model.ids": [1, 2]}, d),
        "exactly dtype, shape and data_offsets",
        "model.ids",
        False,
    ),
    (
        "entry-missing-dtype",
        lambda h, d: ({**h, "model.ids": {k: v for k, v in h["model.ids"].items() if k != "dtype"}}, d),
        "exactly dtype, shape and data_offsets",
        "model.ids",
        False,
    ),
    (
        "entry-extra-key",
        _edit_entry("model.ids", extra="x"),
        "exactly dtype, shape and data_offsets",
        "model.ids",
        True,
    ),
    ("dtype-unknown", _edit_entry("model.ids", dtype="I128"), "unknown dtype 'I128'", "model.ids", False),
    ("dtype-not-string", _edit_entry("model.ids", dtype=["I64"]), "unknown dtype", "model.ids", False),
    ("dtype-lowercase", _edit_entry("model.ids", dtype="i64"), "unknown dtype 'i64'", "model.ids", False),
    ("shape-bool", _edit_entry("model.layer.weight", shape=[True, 11]), "malformed shape", "model.layer.weight", False),
    ("shape-float", _edit_entry("model.layer.weight", shape=[11.0]), "malformed shape", "model.layer.weight", False),
    ("shape-negative", _edit_entry("model.layer.weight", shape=[-11]), "malformed shape", "model.layer.weight", False),
    ("shape-string", _edit_entry("model.layer.weight", shape="11"), "malformed shape", "model.layer.weight", False),
    ("shape-null", _edit_entry("model.layer.weight", shape=None), "malformed shape", "model.layer.weight", False),
    (
        "shape-64-bit",
        _edit_entry("model.layer.weight", shape=[1 << 64]),
        "malformed shape",
        "model.layer.weight",
        False,
    ),
    (
        "shape-overflow",
        _edit_entry("model.layer.weight", shape=[1 << 32, 1 << 32, 0]),
        "more elements than fit in 64 bits",
        "model.layer.weight",
        False,
    ),
    ("bits-overflow", _edit_entry("model.ids", shape=[1 << 58]), "more bits than fit in 64 bits", "model.ids", False),
    (
        "offsets-three",
        lambda h, d: _edit_entry("model.ids", data_offsets=[*h["model.ids"]["data_offsets"], 0])(h, d),
        "malformed data_offsets",
        "model.ids",
        False,
    ),
    ("offsets-bool", _edit_entry("model.ids", data_offsets=[False, 72]), "malformed data_offsets", "model.ids", False),
    (
        "offsets-float",
        lambda h, d: _edit_entry("model.ids", data_offsets=[float(o) for o in h["model.ids"]["data_offsets"]])(h, d),
        "malformed data_offsets",
        "model.ids",
        False,
    ),
    (
        "offsets-negative-zero",
        lambda h, d: (json.dumps(h).replace('"data_offsets": [0,', '"data_offsets": [-0,').encode(), d),
        "malformed data_offsets [-0.0",
        "first",
        False,
    ),
    ("offsets-negative", _edit_entry("model.ids", data_offsets=[-8, 64]), "malformed data_offsets", "model.ids", False),
    (
        "offsets-64-bit",
        _edit_entry("model.ids", data_offsets=[0, 1 << 64]),
        "malformed data_offsets",
        "model.ids",
        False,
    ),
    (
        "gap-at-start",
        lambda h, d: _edit_entry(_first(h), data_offsets=[8, 8 + h[_first(h)]["data_offsets"][1]])(h, b"\x01" * 8 + d),
        "leaves a gap before it (the data must begin at 0)",
        "first",
        False,
    ),
    (
        "overlap",
        lambda h, d: _edit_entry(_last(h), data_offsets=[o - 4 for o in h[_last(h)]["data_offsets"]])(h, d[:-4]),
        "overlaps the tensor before it",
        "last",
        False,
    ),
    (
        "end-before-begin",
        lambda h, d: _edit_entry(_last(h), data_offsets=[h[_last(h)]["data_offsets"][0], 0])(h, d),
        "end before they begin",
        "last",
        False,
    ),
    (
        "size-mismatch",
        lambda h, d: _edit_entry("model.norm.weight", shape=[12])(h, d),
        "has 52 bytes, its shape [12] of F32 needs 48",
        "model.norm.weight",
        False,
    ),
    (
        "dtype-swap",
        lambda h, d: _edit_entry("model.norm.weight", dtype="F16")(h, d),
        "needs 26",
        "model.norm.weight",
        False,
    ),
    ("trailing-bytes", lambda h, d: (h, d + b"\x07" * 3), "3 bytes after the last tensor", None, False),
    ("truncated", lambda h, d: (h, d[:-3]), "truncated", "last", False),
    (
        "metadata-list",
        lambda h, d: ({**h, "__metadata__": ["pt"]}, d),
        "'__metadata__' is not a map of strings to strings",
        None,
        False,
    ),
    (
        "metadata-int",
        lambda h, d: ({**h, "__metadata__": {"format": 1}}, d),
        "'__metadata__' is not a map of strings to strings",
        None,
        False,
    ),
    (
        "metadata-surrogate",
        lambda h, d: (json.dumps(h).replace('"pt"', '"\\ud800"').encode(), d),
        "invalid \\u escape",
        None,
        False,
    ),
    (
        "name-empty",
        lambda h, d: ({**{k: v for k, v in h.items() if k != "model.ids"}, "": h["model.ids"]}, d),
        "tensor name '' is empty or has control characters",
        None,
        True,
    ),
    (
        "name-newline",
        lambda h, d: ({**{k: v for k, v in h.items() if k != "model.ids"}, "model\nids": h["model.ids"]}, d),
        "tensor name 'model\\nids' is empty or has control characters",
        None,
        True,
    ),
    (
        "name-surrogate",
        lambda h, d: (
            json.dumps({**{k: v for k, v in h.items() if k != "model.ids"}, "X": h["model.ids"]})
            .replace('"X"', '"\\udc80"')
            .encode(),
            d,
        ),
        "is empty or has control characters",
        None,
        False,
    ),
]


@pytest.mark.parametrize("case,edit,words,tensor,safetensors_takes", HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_header_rule(case, edit, words, tensor, safetensors_takes, shard):
    header, data = split(shard.read_bytes())
    edited = edit(header, data)
    shard.write_bytes(edited if isinstance(edited, bytes) else join(*edited))
    named = {"first": _first(header), "last": _last(header)}.get(tensor, tensor) if isinstance(header, dict) else tensor
    with pytest.raises(CheckpointError) as caught:
        read_header(shard)
    message = str(caught.value)
    assert message.startswith(f"{shard}: ") and words in message and "\n" not in message, message
    if named is not None:
        assert f"tensor '{named}'" in message, message
    assert len(message) < 400
    # Refused by safetensors too, unless this is one of the places we are stricter on purpose.
    assert (safetensors_reads(shard) is not None) == safetensors_takes


def test_rules_safetensors_keeps_too(shard):
    header, data = split(shard.read_bytes())
    # Listed out of offset order, with two zero-size tensors sharing an offset, and __metadata__ null: all valid.
    order = ["model.layer.weight", "model.ids", "model.norm.weight", "model.embed.weight"]
    header, data = retile(header, data, order)
    header["empty.a"] = {"dtype": "F32", "shape": [0, 5], "data_offsets": [11, 11]}
    header["empty.b"] = {"dtype": "BF16", "shape": [3, 0], "data_offsets": [11, 11]}
    header["__metadata__"] = None
    shard.write_bytes(join(dict(reversed(list(header.items()))), data) + b"")
    ours = our_reads(shard)
    assert ours == safetensors_reads(shard) and set(ours[0]) == {*order, "empty.a", "empty.b"} and ours[1] == {}
    # Padding with spaces after the JSON (safetensors aligns the data to 8 bytes so).
    encoded = json.dumps(header).encode() + b"   "
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    assert our_reads(shard) == safetensors_reads(shard)


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_header(fifo)
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_tensors(tmp_path)


def test_a_directory_is_refused(tmp_path):
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="not a regular file"):
        read_tensors(tmp_path)


# ---- the index and the folder -------------------------------------------------------------------------


def sharded_checkpoint(folder: Path, seed: int) -> dict[str, torch.Tensor]:
    """Two shards and an index, like transformers saves them."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = random_tensors(seed)
    names = sorted(tensors)
    weight_map = {}
    for index, part in enumerate((names[:2], names[2:]), 1):
        filename = f"model-{index:05d}-of-00002.safetensors"
        save_file({name: tensors[name] for name in part}, folder / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, filename))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map})
    )
    return tensors


def check_read(folder: Path, expected: dict[str, torch.Tensor]) -> None:
    infos = read_tensors(folder)
    reader = TensorReader()
    try:
        assert set(infos) == set(expected)
        for name, tensor in expected.items():
            got = reader.tensor(infos[name])
            assert got.dtype == tensor.dtype and torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))
    finally:
        reader.close()


def _write_index(folder: Path, weight_map) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_sharded_checkpoint_reads(tmp_path):
    folder = tmp_path / "ckpt"
    check_read(folder, sharded_checkpoint(folder, 3))


@pytest.mark.parametrize(
    "escape",
    [
        "../outside.safetensors",
        "{abs}",
        "sub/../../outside.safetensors",
        "sub/../model-00001-of-00002.safetensors",
        "./model-00001-of-00002.safetensors",
        "..\\outside.safetensors",
        "C:/outside.safetensors",
        "C:outside.safetensors",
        "//server/share/outside.safetensors",
        "sub//x.safetensors",
    ],
)
def test_index_names_that_escape_are_refused(escape, tmp_path):
    folder = tmp_path / "ckpt"
    sharded_checkpoint(folder, 4)
    # A real safetensors file waits outside, so a reader that followed the name would succeed.
    save_file({"secret": torch.arange(1, 9, dtype=torch.int64)}, tmp_path / "outside.safetensors")
    escape = escape.format(abs=tmp_path / "outside.safetensors")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    weight_map["secret"] = escape
    _write_index(folder, weight_map)
    for read in (read_index, read_tensors):
        with pytest.raises(CheckpointError) as caught:
            read(folder)
        message = str(caught.value)
        assert message.startswith(str(folder / "model.safetensors.index.json")) and "tensor 'secret'" in message, (
            message
        )
        assert "is not a plain relative path inside" in message and "\n" not in message


INDEX_CASES = [
    ("not-object", [1], "no 'weight_map' object"),
    ("no-weight-map", {"metadata": {}}, "no 'weight_map' object"),
    ("weight-map-list", {"weight_map": ["model.safetensors"]}, "no 'weight_map' object"),
    ("file-not-string", {"weight_map": {"model.ids": 1}}, "tensor 'model.ids': file name 1 is not a non-empty string"),
    ("file-empty", {"weight_map": {"model.ids": ""}}, "file name '' is not a non-empty string"),
    (
        "not-safetensors",
        {"weight_map": {"model.ids": "pytorch_model.bin"}},
        "file name 'pytorch_model.bin' is not a .safetensors file",
    ),
    ("name-empty", {"weight_map": {"": "model-00001-of-00002.safetensors"}}, "tensor name '' is empty"),
    ("name-control", {"weight_map": {"a\tb": "model-00001-of-00002.safetensors"}}, "tensor name 'a\\tb' is empty"),
    ("file-control", {"weight_map": {"model.ids": "model\n.safetensors"}}, "is not a plain relative path"),
    (
        "duplicate",
        b'{"weight_map": {"model.ids": "a.safetensors", "model.ids": "b.safetensors"}}',
        "key 'model.ids' appears twice",
    ),
    ("nan", b'{"weight_map": {}, "metadata": {"total_size": NaN}}', "NaN is not JSON"),
    ("deep", b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ("not-utf8", b'{"weight_map": {"\xff": "a.safetensors"}}', "not UTF-8"),
    ("not-json", b'{"weight_map": ', "not JSON"),
]


@pytest.mark.parametrize("case,index,words", INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_bad_index_is_refused(case, index, words, tmp_path):
    folder = tmp_path / "ckpt"
    sharded_checkpoint(folder, 5)
    path = folder / "model.safetensors.index.json"
    path.write_bytes(index if isinstance(index, bytes) else json.dumps(index).encode())
    with pytest.raises(CheckpointError) as caught:
        read_tensors(folder)
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and words in message and "\n" not in message, message


def test_index_naming_a_missing_file_or_tensor(tmp_path):
    folder = tmp_path / "ckpt"
    sharded_checkpoint(folder, 6)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    _write_index(folder, {**weight_map, "extra": "sub/model-00003-of-00002.safetensors"})
    with pytest.raises(CheckpointError, match="model-00003-of-00002.safetensors: listed in the index but missing"):
        read_tensors(folder)
    _write_index(folder, {**weight_map, "extra": "model-00001-of-00002.safetensors"})
    with pytest.raises(CheckpointError, match="the index lists tensor 'extra' but the file does not hold it"):
        read_tensors(folder)


def _three_shards(folder: Path, seed: int) -> tuple[dict, dict]:
    """Three shards of a transformers-style series and their index's weight_map."""
    folder.mkdir(parents=True)
    tensors = random_tensors(seed)
    names = sorted(tensors)
    weight_map = {}
    for index, part in enumerate((names[:1], names[1:3], names[3:]), 1):
        filename = f"model-{index:05d}-of-00003.safetensors"
        save_file({name: tensors[name] for name in part}, folder / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, filename))
    return tensors, weight_map


@pytest.mark.parametrize("case", ["left-out", "shard-left-out", "wrong-file", "wrong-unlisted-file"])
def test_the_index_and_the_shards_must_agree(case, tmp_path):
    """A tensor a shard holds and the index does not list where it is (left out, its shard of the series left out,
    or listed under another file) is refused by the shard's and the tensor's name, never silently dropped."""
    folder = tmp_path / "ckpt"
    tensors, weight_map = _three_shards(folder, 13)
    first = "model-00001-of-00003.safetensors"
    (lone,) = [name for name, file in weight_map.items() if file == first]
    moved = sorted(name for name, file in weight_map.items() if file == "model-00002-of-00003.safetensors")[0]
    if case == "left-out":
        del weight_map[moved]
        shard, words = "model-00002-of-00003.safetensors", f"holds tensor '{moved}', which the index does not list"
    elif case == "shard-left-out":  # the index names no tensor of shard 1: transformers would not even open it
        del weight_map[lone]
        shard, words = first, f"holds tensor '{lone}', which the index does not list"
    elif case == "wrong-file":
        weight_map[moved] = "model-00003-of-00003.safetensors"
        shard, words = (
            "model-00002-of-00003.safetensors",
            f"holds tensor '{moved}', which the index lists under 'model-00003-of-00003.safetensors'",
        )
    else:  # listed under shard 2, held by shard 1, which the index names nowhere else
        weight_map[lone] = "model-00002-of-00003.safetensors"
        shard, words = first, f"holds tensor '{lone}', which the index lists under 'model-00002-of-00003.safetensors'"
    _write_index(folder, weight_map)
    with pytest.raises(CheckpointError) as caught:
        read_tensors(folder)
    assert str(caught.value) == f"{folder / shard}: {words}"


def test_other_safetensors_files_beside_an_index_are_not_the_checkpoint(tmp_path):
    """Only the index's own series is looked at: a Mistral-style consolidated.safetensors or an older series with
    another shard count beside it are no part of the checkpoint (nor an adapter's file)."""
    folder = tmp_path / "ckpt"
    tensors, weight_map = _three_shards(folder, 14)
    _write_index(folder, weight_map)
    for name in (
        "consolidated.safetensors",
        "model-00001-of-00004.safetensors",
        "model-00004-of-00003-old.safetensors",
        "adapter_model.safetensors",
    ):
        save_file({"stray": torch.arange(1, 4, dtype=torch.int32)}, folder / name)
    check_read(folder, tensors)


def test_files_in_a_subfolder_are_fine(tmp_path):
    folder = tmp_path / "ckpt"
    expected = sharded_checkpoint(folder, 7)
    (folder / "weights").mkdir()
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    for file in set(weight_map.values()):
        (folder / file).rename(folder / "weights" / file)
    _write_index(folder, {name: f"weights/{file}" for name, file in weight_map.items()})
    check_read(folder, expected)


# ---- symlinks: the Hub cache's, and the ones that lead out -------------------------------------------


def hub_cache_repo(
    root: Path, seed: int, *, revision: str = "0123456789abcdef0123456789abcdef01234567"
) -> tuple[Path, dict]:
    """A folder shaped like huggingface_hub's cache: snapshots/<rev>/<file> -> ../../blobs/<sha256 or git sha>."""
    staging = root / "staging"
    tensors = sharded_checkpoint(staging, seed)
    repo = root / "hub" / "models--org--tiny-bnb-4bit"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / revision
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for index, path in enumerate(sorted(staging.iterdir())):
        blob = f"{index:02d}" + "ab" * 31  # 64 hex digits, like a sha256
        path.rename(blobs / blob)
        os.symlink(f"../../blobs/{blob}", snapshot / path.name)
    return snapshot, tensors


def test_hub_cache_snapshot_reads(tmp_path):
    snapshot, expected = hub_cache_repo(tmp_path, 8)
    assert (snapshot / "model.safetensors.index.json").is_symlink()
    check_read(snapshot, expected)
    # Through a symlinked cache root as well (HF_HUB_CACHE on another disk).
    os.symlink(tmp_path / "hub", tmp_path / "linked-hub")
    check_read(tmp_path / "linked-hub" / snapshot.relative_to(tmp_path / "hub"), expected)


def test_hub_cache_single_file_without_index(tmp_path):
    repo = tmp_path / "models--org--one"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "main-rev"
    snapshot.mkdir(parents=True)
    tensors = random_tensors(9)
    save_file(tensors, repo / "blobs" / ("cd" * 32))
    os.symlink("../../blobs/" + "cd" * 32, snapshot / "model.safetensors")
    check_read(snapshot, tensors)


def test_symlink_inside_the_folder_is_fine(tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "store").mkdir(parents=True)
    tensors = random_tensors(10)
    save_file(tensors, folder / "store" / "weights.bin")
    os.symlink("store/weights.bin", folder / "model.safetensors")
    check_read(folder, tensors)


@pytest.mark.parametrize(
    "case", ["outside", "other-repo-blobs", "blob-subfolder", "index-link", "loop", "not-a-snapshot"]
)
def test_symlinks_that_lead_out_are_refused(case, tmp_path):
    snapshot, _ = hub_cache_repo(tmp_path, 12)
    repo = snapshot.parent.parent
    outside = tmp_path / "private.safetensors"
    save_file({"private": torch.arange(1, 5, dtype=torch.int32)}, outside)
    shard = snapshot / "model-00001-of-00002.safetensors"
    target = os.readlink(shard)
    shard.unlink()
    if case == "outside":
        os.symlink(outside, shard)
    elif case == "other-repo-blobs":
        other = tmp_path / "hub" / "models--someone--else" / "blobs"
        other.mkdir(parents=True)
        (repo / target.removeprefix("../../")).rename(other / "ff")
        os.symlink("../../../models--someone--else/blobs/ff", shard)
    elif case == "blob-subfolder":
        (repo / "blobs" / "sub").mkdir()
        (repo / target.removeprefix("../../")).rename(repo / "blobs" / "sub" / "ff")
        os.symlink("../../blobs/sub/ff", shard)
    elif case == "index-link":
        os.symlink(target, shard)
        index = snapshot / "model.safetensors.index.json"
        (tmp_path / "index.json").write_bytes(index.read_bytes())
        index.unlink()
        os.symlink(tmp_path / "index.json", index)
        shard = index
    elif case == "loop":
        os.symlink(shard.name, shard)
    elif case == "not-a-snapshot":
        # The same links from a folder that is not <repo>/snapshots/<rev>: blobs are only a snapshot's way out.
        os.symlink(target, shard)
        (repo / "elsewhere").mkdir()
        snapshot = snapshot.rename(repo / "elsewhere" / snapshot.name)
        shard = snapshot / "model.safetensors.index.json"
    with pytest.raises(CheckpointError) as caught:
        read_tensors(snapshot)
    message = str(caught.value)
    assert message.startswith(f"{shard}: ") and "\n" not in message, message
    assert ("outside the checkpoint folder" in message) != (case == "loop"), message


# ---- what we write, safetensors and we read back -------------------------------------------------------


_Out = collections.namedtuple("_Out", "name dtype shape nbytes")  # what ShardWriter reads of a planned tensor


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shard_writer_output_round_trips(seed, tmp_path):
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for index in range(int(torch.randint(1, 9, (1,), generator=generator))):
        code = list(TORCH_DTYPES)[int(torch.randint(0, len(TORCH_DTYPES), (1,), generator=generator))]
        shape = tuple(
            int(d)
            for d in torch.randint(0, 9, (int(torch.randint(0, 4, (1,), generator=generator)),), generator=generator)
        )
        values = torch.randint(1, 120, shape, generator=generator, dtype=torch.int32)
        tensors[f"layers.{index}.w{seed}"] = (code, values.to(TORCH_DTYPES[code]))
    outputs = [_Out(name, code, tuple(t.shape), t.numel() * t.element_size()) for name, (code, t) in tensors.items()]
    path = tmp_path / "model.safetensors"
    writer = ShardWriter(path, outputs)
    for name, (_, tensor) in tensors.items():
        writer.write(name, tensor)
    writer.close()
    assert path.read_bytes().startswith(shard_header(outputs)) and (len(shard_header(outputs)) - 8) % 8 == 0
    expected = {name: (code, tuple(t.shape), tensor_bytes(t)) for name, (code, t) in tensors.items()}
    assert safetensors_reads(path) == our_reads(path) == (expected, {"format": "pt"})


def test_an_empty_shard_round_trips(tmp_path):
    path = tmp_path / "model.safetensors"
    ShardWriter(path, []).close()
    assert safetensors_reads(path) == our_reads(path) == ({}, {"format": "pt"})
