"""verify checks the output's files as transformers finds them, not only its tensors: a sharded output has its index,
mapping exactly its tensors to the files that hold them (with their total size), a single file is model.safetensors,
no other weight file stands beside them, and every file the conversion carries over is there with the source's bytes.

Each case edits a copy of an output that verifies OK, so a failure can only come from the edit."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from checkpoints import build
from nf4convert.cli import main
from nf4convert.errors import CheckpointError
from nf4convert.verification import verify

INDEX = "model.safetensors.index.json"


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A 4-bit source with files to carry (one in a subfolder), converted sharded and into one file; both verify OK."""
    root = tmp_path_factory.mktemp("verify-extra")
    source = build(root / "src-bnb-4bit", "llama-nf4-dq", seed=21)
    (source / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6}))
    (source / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    (source / "extra").mkdir()
    (source / "extra" / "notes.txt").write_text("kept as is\n")
    outputs = {}
    for layout, size in (("sharded", "200KB"), ("single", "5GB")):
        outputs[layout] = root / layout
        run(source, "-o", outputs[layout], "-q", "--device", "cpu", "--max-shard-size", size)
        assert "OK: bit-exact" in run("verify", outputs[layout], source, "-q", "--device", "cpu")
    assert len(list(outputs["sharded"].glob("model-*-of-*.safetensors"))) >= 3 and (outputs["sharded"] / INDEX).is_file()
    assert [p.name for p in outputs["single"].glob("*.safetensors*")] == ["model.safetensors"]
    return source, outputs


def problems(output, source) -> list[str]:
    report = verify(output, str(source), device="cpu")
    assert report.checked > 0
    return report.problems


def copy_of(converted, layout, tmp_path):
    source, outputs = converted
    out = tmp_path / layout
    shutil.copytree(outputs[layout], out, symlinks=True)
    return source, out


def edit_index(out, edit):
    index = json.loads((out / INDEX).read_text())
    edit(index)
    (out / INDEX).write_text(json.dumps(index))


def test_a_sharded_output_without_its_index_fails(converted, tmp_path):
    source, out = copy_of(converted, "sharded", tmp_path)
    shards = len(list(out.glob("*.safetensors")))
    (out / INDEX).unlink()
    assert problems(out, source) == [f"{INDEX}: missing; transformers loads none of the output's {shards} shards without it"]
    output = run("verify", out, source, "-q", "--device", "cpu", code=1)
    assert f"MISMATCH {INDEX}: missing" in output and "FAILED: 1 problem" in output


def test_an_index_under_another_name_fails(converted, tmp_path):
    source, out = copy_of(converted, "sharded", tmp_path)
    (out / INDEX).rename(out / "weights.safetensors.index.json")
    assert problems(out, source) == [f"{INDEX}: missing (the output's index is named weights.safetensors.index.json, "
                                     "which transformers does not look for)"]  # fmt: skip


@pytest.mark.parametrize("case", ["total-size", "no-total-size", "no-metadata"])
def test_the_index_metadata_is_checked(case, converted, tmp_path):
    source, out = copy_of(converted, "sharded", tmp_path)
    total = json.loads((out / INDEX).read_text())["metadata"]["total_size"]
    if case == "total-size":
        edit_index(out, lambda index: index["metadata"].update(total_size=total + 2))
        expected = f"{INDEX}: metadata.total_size is {total + 2}, the shards hold {total} bytes of tensors"
    elif case == "no-total-size":
        edit_index(out, lambda index: index["metadata"].pop("total_size"))
        expected = f"{INDEX}: metadata.total_size is None, the shards hold {total} bytes of tensors"
    else:
        edit_index(out, lambda index: index.pop("metadata"))
        expected = f"{INDEX}: no 'metadata' object (transformers' loader reads it)"
    assert problems(out, source) == [expected]


@pytest.mark.parametrize("case", ["left-out", "wrong-file"])
def test_an_index_that_does_not_map_the_output_exactly_is_refused(case, converted, tmp_path):
    source, out = copy_of(converted, "sharded", tmp_path)
    weight_map = json.loads((out / INDEX).read_text())["weight_map"]
    name, file = sorted(weight_map.items())[0]
    other = next(f for f in sorted(set(weight_map.values())) if f != file)
    if case == "left-out":
        edit_index(out, lambda index: index["weight_map"].pop(name))
        words = f"{out / file}: holds tensor '{name}', which the index does not list"
    else:
        edit_index(out, lambda index: index["weight_map"].update({name: other}))
        words = f"{out / file}: holds tensor '{name}', which the index lists under '{other}'"
    with pytest.raises(CheckpointError) as caught:
        verify(out, str(source), device="cpu")
    assert str(caught.value) == words
    result = CliRunner().invoke(main, ["verify", str(out), str(source), "-q", "--device", "cpu"])
    assert result.exit_code == 1 and result.output.strip().splitlines() == [f"Error: {words}"], result.output


@pytest.mark.parametrize("stray", ["model.safetensors", "extra.safetensors"])
def test_another_weight_file_beside_the_shards_fails(stray, converted, tmp_path):
    source, out = copy_of(converted, "sharded", tmp_path)
    shutil.copy(next(out.glob("model-*.safetensors")), out / stray)
    expected = {"model.safetensors": "model.safetensors: beside the index; transformers loads it and ignores the shards",
                "extra.safetensors": "extra.safetensors: a .safetensors file the index does not name"}[stray]
    assert problems(out, source) == [expected]


def test_a_single_file_output_must_be_named_model_safetensors(converted, tmp_path):
    source, out = copy_of(converted, "single", tmp_path)
    (out / "model.safetensors").rename(out / "weights.safetensors")
    assert problems(out, source) == ["weights.safetensors: a single-file output must be named model.safetensors "
                                     "(the only name transformers looks for)"]  # fmt: skip


@pytest.mark.parametrize("layout", ["sharded", "single"])
@pytest.mark.parametrize("file", ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                  "extra/notes.txt"])  # fmt: skip
@pytest.mark.parametrize("how", ["missing", "changed"])
def test_every_carried_file_must_be_there_with_the_source_bytes(layout, file, how, converted, tmp_path):
    source, out = copy_of(converted, layout, tmp_path)
    if how == "missing":
        (out / file).unlink()
        expected = f"{file}: carried over from the source, missing from the output"
    else:  # the same size, one byte changed: compared by content, not by size or time
        data = bytearray((out / file).read_bytes())
        data[len(data) // 2] ^= 0x20
        (out / file).write_bytes(bytes(data))
        expected = f"{file}: differs from the source's"
    assert problems(out, source) == [expected]


def test_the_model_card_is_not_compared(converted, tmp_path):
    """README.md is written anew (the source's card made true for the dense model): not a carried file."""
    source, out = copy_of(converted, "sharded", tmp_path)
    assert (out / "README.md").read_text() != (source / "README.md").read_text()
    (out / "README.md").write_text("# another card\n")
    assert problems(out, source) == []


@pytest.mark.parametrize("stray", ["adapter_config.json", "adapter_model.safetensors", "pytorch_model.bin"])
def test_files_no_conversion_writes_fail(stray, converted, tmp_path):
    # an adapter's files make transformers load the base they name plus the adapter; a .bin is another copy of weights
    source, out = copy_of(converted, "single", tmp_path)
    (out / stray).write_text("{}")
    found = problems(out, source)
    assert any(p.startswith(f"{stray}: in the output, but no conversion writes it") for p in found), found
