"""plan and the shard writer, from small hand-made checkpoints: recipes, sizes, shards, offsets, what is read."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nf4convert.dtypes import output_dtype
from nf4convert.errors import ArgumentError, CheckpointError
from nf4convert.kinds.copy import Copy
from nf4convert.kinds.dequantize_4bit import Dequantize4bit
from nf4convert.plan import make_plan
from nf4convert.safetensors_io.read import TensorReader, read_tensors
from nf4convert.safetensors_io.write import ShardWriter
from nf4convert.sizes import parse_size

from fixtures.weights import quantize

pytest.importorskip("bitsandbytes")


def _checkpoint(folder, *, drop=None):
    """Two shards: a nested NF4 bf16 weight whose quant state sits in the second shard, a flat FP4 fp16 weight,
    an fp32 norm and an int64 buffer; plus an index and side files."""
    a_packed, a_state = quantize((48, 83), quant_type="nf4", blocksize=64, nested=True, dtype=torch.bfloat16, seed=1)
    b_packed, b_state = quantize((16, 40), quant_type="fp4", blocksize=128, nested=False, dtype=torch.bfloat16, seed=2)
    first = {
        "a.weight": a_packed,
        "b.weight": b_packed,
        "norm.weight": torch.randn(83, generator=torch.Generator().manual_seed(3)),
        "ids": torch.arange(7),
        **{f"b.weight.{k}": v for k, v in b_state.as_dict(packed=True).items()},
    }
    second = {f"a.weight.{k}": v for k, v in a_state.as_dict(packed=True).items()}
    for shard in (first, second):
        for key in [k for k in shard if k == drop]:
            del shard[key]
    folder.mkdir()
    save_file(first, folder / "one.safetensors")
    save_file(second, folder / "two.safetensors")
    weight_map = {**{k: "one.safetensors" for k in first}, **{k: "two.safetensors" for k in second}}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(
        json.dumps({"quantization_config": {"load_in_4bit": True}, "text_config": {"quantization_config": {}}})
    )
    (folder / "tokenizer.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"old weights")
    return folder


def test_recipes_sizes_and_side_files(tmp_path):
    plan = make_plan(_checkpoint(tmp_path / "src"))
    recipes = {tensor.name: tensor for tensor in plan.tensors}
    assert sorted(recipes) == ["a.weight", "b.weight", "ids", "norm.weight"]  # no quant-state part is an output
    assert isinstance(recipes["a.weight"].recipe, Dequantize4bit) and recipes["a.weight"].recipe.weight.nested
    assert isinstance(recipes["norm.weight"].recipe, Copy)
    assert plan.dtype.name == "bfloat16"  # auto: the dtype the weights were quantized from
    assert (recipes["a.weight"].dtype, recipes["a.weight"].shape, recipes["a.weight"].nbytes) == (
        "BF16",
        (48, 83),
        48 * 83 * 2,
    )
    assert (recipes["norm.weight"].dtype, recipes["ids"].dtype) == ("BF16", "I64")  # floats cast, integers kept
    assert plan.tensor_bytes == sum(math.prod(t.shape) * (8 if t.dtype == "I64" else 2) for t in plan.tensors)
    assert plan.n_dequantized == 2
    assert [str(p) for p in plan.side_files] == ["tokenizer.json"]  # not the .bin, the index, or config.json
    assert plan.config == {"text_config": {}, "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    # Sources resolved through the index wherever they sit.
    assert {info.path.name for info in recipes["a.weight"].recipe.sources} == {"one.safetensors", "two.safetensors"}


@pytest.mark.parametrize("limit", [1, 5000, 10**9])
def test_shards_and_offsets(tmp_path, limit):
    plan = make_plan(_checkpoint(tmp_path / "src"), dtype=output_dtype("float32"), max_shard_size=limit)
    assert plan.dtype.name == "float32"
    names = [shard.filename for shard in plan.shards]
    assert names == (
        ["model.safetensors"]
        if len(names) == 1
        else [f"model-{i:05d}-of-{len(names):05d}.safetensors" for i in range(1, len(names) + 1)]
    )
    for shard in plan.shards:
        assert shard.nbytes <= limit or len(shard.tensors) == 1
        offset = 0
        for tensor in shard.tensors:
            assert (tensor.shard, tensor.offset) == (shard.filename, offset)
            offset += tensor.nbytes
    assert len(plan.shards) == {1: 4, 5000: 3, 10**9: 1}[limit]


def test_plan_reads_only_quant_states_and_maps(tmp_path, monkeypatch):
    read = []
    original = TensorReader.read

    def recording(self, info, *args, **kwargs):
        read.append(info.name)
        return original(self, info, *args, **kwargs)

    monkeypatch.setattr(TensorReader, "read", recording)
    make_plan(_checkpoint(tmp_path / "src"))
    # the JSON and code tables, and for a nested state its small nested absmax (one float per 256 blocks)
    assert sorted(read) == [
        "a.weight.nested_absmax",
        "a.weight.nested_quant_map",
        "a.weight.quant_map",
        "a.weight.quant_state.bitsandbytes__nf4",
        "b.weight.quant_map",
        "b.weight.quant_state.bitsandbytes__fp4",
    ]


@pytest.mark.parametrize(
    "drop,message",
    [
        ("a.weight.quant_state.bitsandbytes__nf4", "is part of the 4-bit quant state of 'a.weight', which has no"),
        ("b.weight.quant_state.bitsandbytes__fp4", "is part of the 4-bit quant state of 'b.weight'"),
        ("a.weight.nested_absmax", "quant state is missing 'a.weight.nested_absmax'"),
        ("b.weight", "has no packed weight 'b.weight'"),
    ],
)
def test_incomplete_quant_state_is_refused(tmp_path, drop, message):
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        make_plan(_checkpoint(tmp_path / "src", drop=drop))


def test_bad_options(tmp_path):
    with pytest.raises(ArgumentError, match="dtype 'int8' is not one of auto, bf16"):
        output_dtype("int8")
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size(" 300kb ") == 300_000
    assert parse_size(123) == 123
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size(str(2**63 - 1)) == 2**63 - 1
    for bad in ("inf", "1e400", "-1", "0", "lots", "5XB", "nan", True, str(2**63), "9223372036854775809"):
        with pytest.raises(ArgumentError, match="size"):
            parse_size(bad)


def test_shard_writer_round_trips_through_safetensors(tmp_path):
    plan = make_plan(_checkpoint(tmp_path / "src"), dtype=output_dtype("fp16"), max_shard_size=5000)
    generator = torch.Generator().manual_seed(11)
    written = {}
    for shard in plan.shards:
        writer = ShardWriter(tmp_path / shard.filename, shard.tensors)
        for tensor in shard.tensors:
            data = torch.randint(0, 255, (tensor.nbytes,), dtype=torch.uint8, generator=generator)
            written[tensor.name] = data
            half = tensor.nbytes // 2
            writer.write(tensor.name, data[:half])  # in two pieces, as the stream writes chunks
            writer.write(tensor.name, data[half:])
        writer.close()
        with safe_open(tmp_path / shard.filename, "pt") as file:
            assert file.metadata() == {"format": "pt"}
            for tensor in shard.tensors:
                got = file.get_tensor(tensor.name)
                assert tuple(got.shape) == tensor.shape and torch.equal(
                    got.contiguous().view(-1).view(torch.uint8), written[tensor.name]
                )
    assert set(read_tensors(tmp_path)) >= set(written)  # our own reader takes what we wrote
    # Out of order or short writes are bugs, caught loudly.
    writer = ShardWriter(tmp_path / "x.safetensors", plan.shards[0].tensors)
    with pytest.raises(RuntimeError, match="comes next"):
        writer.write("no-such-tensor", torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="tensors unwritten"):
        writer.close()


def test_side_files_linked_out_of_the_folder_are_refused(tmp_path):
    import os

    secret = tmp_path / "secret.txt"
    secret.write_text("not for the output")
    folder = _checkpoint(tmp_path / "src")
    os.symlink(secret, folder / "tokenizer_extra.txt")
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        make_plan(folder)
    (folder / "tokenizer_extra.txt").unlink()
    os.symlink(folder / "tokenizer.json", folder / "tokenizer_alias.json")  # a link inside the folder is fine
    assert "tokenizer_alias.json" in [str(p) for p in make_plan(folder).side_files]


def test_a_weight_that_is_both_4bit_and_8bit_is_refused(tmp_path):
    # before, the 8-bit recipe replaced the 4-bit one: the packed bytes came out read as int8, the quant state copied
    folder = _checkpoint(tmp_path / "src")
    with safe_open(folder / "one.safetensors", "pt") as file:
        first = {key: file.get_tensor(key) for key in file.keys()}
    first["b.weight"] = first["b.weight"].view(torch.int8)
    first["b.SCB"] = torch.ones(first["b.weight"].shape[0])
    save_file(first, folder / "one.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["b.SCB"] = "one.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"one.safetensors: tensor 'b.weight' has both a 4-bit quant state and an 8-bit SCB"
    ):
        make_plan(folder)


@pytest.mark.parametrize("depth", [65, 600, 100_000])
def test_a_config_nested_too_deeply_is_refused(tmp_path, depth):
    # 600 levels parse, then walking them (dense_config) overflowed the stack: a traceback
    folder = _checkpoint(tmp_path / "src")
    (folder / "config.json").write_text('{"deep": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(CheckpointError, match=r"config.json: not JSON that can be read \(nested too deeply\)"):
        make_plan(folder)


def test_a_dangling_config_link_is_refused_not_taken_for_none(tmp_path):
    folder = _checkpoint(tmp_path / "src")
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(folder / "gone.json")
    with pytest.raises(CheckpointError, match=r"config.json: cannot be read \(No such file or directory\)"):
        make_plan(folder)


@pytest.mark.parametrize("kind", ["dangling link", "pipe", "skipped name"])
def test_side_files_that_are_no_files_are_refused_when_planning(tmp_path, kind):
    # a dangling tokenizer link (a Hub snapshot whose blob never arrived) or a pipe was left out without a word, and
    # verify, which checks the weights, said OK; a name the plan skips anyway (a lock file) stays skipped
    import os

    snapshot = tmp_path / "repo" / "snapshots" / "abc"
    (tmp_path / "repo" / "blobs").mkdir(parents=True)
    snapshot.parent.mkdir()
    folder = _checkpoint(snapshot)
    target = folder / ("x.lock" if kind == "skipped name" else "vocab.txt")
    if kind == "pipe":
        os.mkfifo(target)
    else:
        target.symlink_to("../../blobs/never-downloaded")
    if kind == "skipped name":
        assert "x.lock" not in [path.as_posix() for path in make_plan(folder).side_files]
        return
    message = "which does not exist" if kind == "dangling link" else "is not a regular file"
    with pytest.raises(CheckpointError, match=f"vocab.txt: .*{message}"):
        make_plan(folder)


def test_side_files_that_cannot_be_read_are_refused_when_planning(tmp_path, monkeypatch):
    # before, an unreadable folder's files were left out without a word (rglob skips it) and an unreadable file failed
    # the output's writing after every tensor, blamed on OUT (root reads anything: the refusals are simulated)
    import os

    folder = _checkpoint(tmp_path / "src")
    (folder / "sub").mkdir()
    (folder / "sub" / "notes.txt").write_text("x")
    scandir = os.scandir

    def refusing(path="."):
        if str(path).endswith("sub"):
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", refusing)
    with pytest.raises(
        CheckpointError, match=r"src/sub: cannot be read \(Permission denied\); its files would be missing"
    ):
        make_plan(folder)
    monkeypatch.setattr(os, "scandir", scandir)
    access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: not str(path).endswith("tokenizer.json") and access(path, mode)
    )
    with pytest.raises(
        CheckpointError, match=r"tokenizer.json: cannot be read \(permission denied\); it is carried over"
    ):
        make_plan(folder)


def test_links_to_folders_are_not_followed(tmp_path):
    # a folder's own files are carried; a link to a folder (inside, outside, or back up) is not walked: following
    # them refused a source with a link to an outside folder and, for an inside one, kept the files under one name
    folder = _checkpoint(tmp_path / "src")
    (folder / "shared").mkdir()
    (folder / "shared" / "a.txt").write_text("x")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "run.txt").write_text("log")
    (folder / "alias").symlink_to("shared")
    (folder / "wandb").symlink_to(tmp_path / "outside")
    (folder / "shared" / "up").symlink_to(folder)
    assert [p.as_posix() for p in make_plan(folder).side_files] == ["shared/a.txt", "tokenizer.json"]


@pytest.mark.parametrize("part", ["absmax", "quant_map"])
def test_quant_state_parts_that_are_not_flat_are_refused(tmp_path, part):
    # a [n, 1] absmax converted (flattened) but bitsandbytes, verify's reference, could not take it: refused instead
    folder = _checkpoint(tmp_path / "src")
    with safe_open(folder / "one.safetensors", "pt") as file:
        first = {key: file.get_tensor(key) for key in file.keys()}
    first[f"b.weight.{part}"] = first[f"b.weight.{part}"].reshape(-1, 1)
    save_file(first, folder / "one.safetensors")
    with pytest.raises(
        CheckpointError,
        match=rf"one.safetensors: b.weight: 'b.weight.{part}' has shape \[\d+, 1\]; "
        "bitsandbytes keeps the parts of a quant state 1-D",
    ):
        make_plan(folder)


def test_a_size_is_a_whole_number_of_bytes_and_named_as_the_api_spells_it():
    # '1.5' became 1 byte (shards of one tensor each) and '0.4' "must be positive"; messages said "size"
    assert parse_size("1.5KB") == 1500 and parse_size("1e3") == 1000
    for bad in ("1.5", "0.4", "1.0000001KB"):
        with pytest.raises(
            ArgumentError,
            match=rf"^max_shard_size '{re.escape(bad)}' is not like '5GB', '500MB' or a whole number of bytes$",
        ):
            parse_size(bad)
    with pytest.raises(ArgumentError, match=r"^max_shard_size '0' must be positive"):
        parse_size("0")
