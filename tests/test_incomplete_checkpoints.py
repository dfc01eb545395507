"""An incomplete checkpoint is never converted or verified as complete: a numbered shard series with a shard missing
(no index, or an index edited to match what is left) is refused naming the shard, and verify names every parameter of
transformers' model that the output lacks, which transformers would otherwise fill with random values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from nf4convert.cli.commands import main

pytest.importorskip("bitsandbytes")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama-bnb-4bit"
INDEX = "model.safetensors.index.json"


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output + result.stderr
    return result


def one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0]


@pytest.fixture
def source(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(EXAMPLE, copy)
    return copy


def _drop_shard(source: Path, shard: str, *, edit_index: bool) -> None:
    index = json.loads((source / INDEX).read_text())
    (source / shard).unlink()
    if edit_index:  # as a user would, to make the index match what is left
        index["weight_map"] = {name: file for name, file in index["weight_map"].items() if file != shard}
        (source / INDEX).write_text(json.dumps(index))
    else:
        (source / INDEX).unlink()


@pytest.mark.parametrize("shard", ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"])
@pytest.mark.parametrize("edit_index", [False, True], ids=["no-index", "index-edited"])
def test_a_shard_series_with_a_gap_is_refused_naming_the_shard(tmp_path, source, shard, edit_index):
    # both converted "bit-exact", the shard's weights silently left out
    _drop_shard(source, shard, edit_index=edit_index)
    for out, extra in (("out", []), ("out", ["--dry-run"]), ("out.gguf", ["--dry-run"])):
        line = one_error_line(run(source, "-o", tmp_path / out, "-q", "--device", "cpu", *extra, code=1))
        assert line.startswith(f"Error: {source / shard}: missing, 1 of the 3 shards of the series are"), line
    complete = tmp_path / "complete"
    run(EXAMPLE, "-o", complete, "-q", "--device", "cpu")
    line = one_error_line(run("verify", complete, source, "-q", "--device", "cpu", code=1))
    assert line.startswith(f"Error: {source / shard}: missing"), line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["complete", "src"]


def test_a_series_read_from_one_past_its_count_is_refused(tmp_path, source):
    (source / INDEX).unlink()
    (source / "model-00003-of-00003.safetensors").rename(source / "model-00004-of-00003.safetensors")
    line = one_error_line(run(source, "-o", tmp_path / "out", "-q", "--device", "cpu", code=1))
    assert line == f"Error: {source / 'model-00004-of-00003.safetensors'}: shard 4 of a series of 3"


def _without(source: Path, names: set[str]) -> None:
    """The checkpoint with the tensors ``names`` gone from its shards and its index, consistently."""
    from safetensors.torch import load_file, save_file

    index = json.loads((source / INDEX).read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(source / shard)
        if names & set(tensors):
            save_file({k: v for k, v in tensors.items() if k not in names}, source / shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in names}
    (source / INDEX).write_text(json.dumps(index))


def test_convert_refuses_and_verify_names_every_parameter_the_model_has_and_the_output_lacks(
    tmp_path, source, monkeypatch
):
    # a whole quantized weight (and the untied head) absent: once converted, verified OK, loaded with random values
    from nf4convert import plan

    weight = "model.layers.1.mlp.down_proj.weight"
    index = json.loads((source / INDEX).read_text())
    _without(source, {name for name in index["weight_map"] if name.startswith(weight)} | {"lm_head.weight"})
    for extra in ([], ["--dry-run"]):
        line = one_error_line(run(source, "-o", tmp_path / "out", "-q", "--device", "cpu", *extra, code=1))
        assert line.startswith(
            f"Error: {source}: lm_head.weight: transformers' LlamaForCausalLM has this parameter and the checkpoint "
            "lacks it"
        ) and line.endswith("(and 1 more); the checkpoint does not fit the model of its config.json"), line
    assert not (tmp_path / "out").exists()
    with monkeypatch.context() as patched:  # an output made so all the same, as before convert checked
        patched.setattr(plan, "check_fits", lambda *args: None)
        run(source, "-o", tmp_path / "out", "-q", "--device", "cpu")
    lines = run("verify", tmp_path / "out", source, "-q", "--device", "cpu", code=1).stdout.splitlines()
    lacks = "transformers' LlamaForCausalLM has this parameter, the source and the output lack it"
    assert f"  MISMATCH lm_head.weight: {lacks} (transformers would fill it with random values)" in lines
    assert f"  MISMATCH {weight}: {lacks} (transformers would fill it with random values)" in lines
    assert lines[-1] == "FAILED: 2 problems"
    run(EXAMPLE, "-o", tmp_path / "complete", "-q", "--device", "cpu")
    assert "OK: bit-exact" in run("verify", tmp_path / "complete", EXAMPLE, "-q", "--device", "cpu").stdout


def test_a_tied_head_absent_from_the_checkpoint_is_no_missing_parameter(tmp_path, source):
    # transformers ties lm_head to the embeddings: a checkpoint without it is complete
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    _without(source, {"lm_head.weight"})
    run(source, "-o", tmp_path / "out", "-q", "--device", "cpu")
    assert "OK: bit-exact" in run("verify", tmp_path / "out", source, "-q", "--device", "cpu").stdout
