"""A batch run again into the same root: outputs there already are skipped (or verified as they are), so a batch can
be resumed; --verify checks each output a batch converts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from nf4convert.cli.commands import main

pytest.importorskip("bitsandbytes")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"


def batch(*args, code):
    result = CliRunner().invoke(main, ["batch", *map(str, args)], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result


def rows(result) -> dict[str, dict]:
    return {Path(row["source"]).name: row for row in map(json.loads, result.stdout.splitlines())}


@pytest.fixture
def sources(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("a-bnb-4bit", "b-bnb-4bit", "c-bnb-4bit"):
        shutil.copytree(EXAMPLE, tmp_path / name)
    return ["a-bnb-4bit", "b-bnb-4bit", "c-bnb-4bit"]


def test_a_batch_run_again_skips_what_is_there_and_verifies_it_when_asked(sources, tmp_path):
    a, b, c = sources
    common = ["-o", "root", "-q", "--device", "cpu"]
    batch(a, *common, code=0)
    before = (tmp_path / "root" / "a-bf16" / "model.safetensors").stat().st_mtime_ns
    # without --skip-existing the output there fails its row, saying both ways out
    again = batch(a, b, *common, code=1)
    assert "(pass --skip-existing to keep it, or --overwrite to replace it)" in again.stderr
    # auto dtype (the output known once planned) and a given one (known at once)
    for dtype in ("auto", "bf16"):
        found = rows(batch(a, b, *common, "--dtype", dtype, "--skip-existing", "--json", code=0))
        assert found["a-bnb-4bit"]["status"] == found["b-bnb-4bit"]["status"] == "skipped"
        assert found["a-bnb-4bit"]["existing"] and found["a-bnb-4bit"]["output"] == str(Path("root") / "a-bf16")
    assert (tmp_path / "root" / "a-bf16" / "model.safetensors").stat().st_mtime_ns == before  # not touched

    planned = batch(a, c, *common, "--skip-existing", "--dry-run", "--json", code=0)
    assert [row["status"] for row in rows(planned).values()] == ["skipped", "planned"]
    assert f"to write: {rows(planned)['c-bnb-4bit']['bytes'] / 1e9:.3f}" in planned.stderr  # c's bytes alone

    # --verify: what is there is verified as it is; what is converted, once converted; a mismatch fails its row only
    weights = tmp_path / "root" / "b-bf16" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-2] ^= 0x40
    weights.write_bytes(bytes(data))
    checked = batch(a, b, c, *common, "--skip-existing", "--verify", "--json", code=1)
    found = rows(checked)
    assert found["a-bnb-4bit"]["status"] == "verified" and found["a-bnb-4bit"]["existing"]
    assert found["a-bnb-4bit"]["tensors"] == 39
    assert found["b-bnb-4bit"]["status"] == "failed" and found["b-bnb-4bit"]["existing"]
    assert found["b-bnb-4bit"]["error"].startswith(f"{Path('root') / 'b-bf16'}: verification failed (1 problem, ")
    assert found["b-bnb-4bit"]["error"].endswith("); the output is kept") and weights.read_bytes() == bytes(data)
    assert found["c-bnb-4bit"]["status"] == "verified" and not found["c-bnb-4bit"]["existing"]
    assert found["c-bnb-4bit"]["bytes"] > 0 and "1 of 3 failed" in checked.stderr
    assert sorted(path.name for path in (tmp_path / "root").iterdir()) == ["a-bf16", "b-bf16", "c-bf16"]


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--skip-existing", "--overwrite"], "--skip-existing keeps an output that is there, --overwrite replaces it"),
        (["--dry-run", "--verify"], "--dry-run writes nothing, so there is nothing to --verify"),
    ],
)
def test_flags_that_contradict_each_other_are_a_usage_error(sources, tmp_path, flags, says):
    result = batch(sources[0], "-o", "root", *flags, code=2)
    assert result.output.startswith(f"Error: {says}") and not (tmp_path / "root").exists()


def test_each_sources_own_warnings_are_said_for_it_in_text_and_json(sources, tmp_path):
    # two sources with the same overflow in fp16: the second's warning is its own, not the first's said again
    from safetensors.torch import load_file, save_file

    a, b, c = sources
    for name in (a, b):
        shard = next(p for p in sorted((tmp_path / name).glob("*.safetensors")) if "model.norm.weight" in load_file(p))
        tensors = load_file(shard)
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1e6
        save_file(tensors, shard, metadata={"format": "pt"})
    common = ["-q", "--device", "cpu", "--dtype", "fp16"]
    said = batch(a, b, c, "-o", "text", *common, code=0)
    warned = [line for line in said.stderr.splitlines() if line.startswith("Warning: ")]
    assert [line.split(":")[1].strip() for line in warned] == [a, b], said.stderr
    assert all("model.norm.weight" in line and "holds ±inf in fp16" in line for line in warned)
    found = rows(batch(a, b, c, "-o", "json", *common, "--json", code=0))
    for name in (a, b):
        [warning] = found[f"{name}"]["warnings"]
        assert "model.norm.weight" in warning and "holds ±inf in fp16" in warning
    assert found[c]["warnings"] == []


def test_a_failed_rows_error_is_shown_in_the_table(sources, tmp_path):
    a, b, _ = sources
    (tmp_path / b / "config.json").write_text("{not json")
    result = batch(a, b, "-o", "root", "-q", "--device", "cpu", code=1)
    header, *lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert header.split()[-1] == "error"
    [failed] = [line for line in lines if line.startswith(b)]
    assert "failed" in failed and "config.json" in failed, failed
