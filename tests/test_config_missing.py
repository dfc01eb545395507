"""A source without config.json: refused in one line unless the user asks for its tensors alone, and then an output
whose card and verification say what it lacks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from nf4convert.cli.commands import main
from nf4convert.verification.reference.dequantize_4bit import CPU_REFERENCE

pytest.importorskip("bitsandbytes")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture
def configless(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(EXAMPLE, tmp_path / "src")
    (tmp_path / "src" / "config.json").unlink()
    return "src"


def test_a_source_without_config_is_refused_in_one_line(configless, tmp_path):
    # it converted silently into a folder transformers cannot load
    refusal = (
        "Error: src: has no config.json, so its output would not load in transformers as a model (it reads the "
        "model's type there); add the model's config.json to it (or pass --allow-no-config to write the dense "
        "tensors alone)\n"
    )
    assert run(configless, "-o", "out", "-q", code=1) == refusal
    assert run(configless, "-o", "out", "--dry-run", code=1) == refusal  # a dry run refuses it too
    table = run("batch", configless, "-o", "root", "-q", code=1)
    assert refusal in table and "1 of 1 failed" in table
    assert sorted(path.name for path in tmp_path.iterdir()) == ["src"]


def test_its_tensors_alone_when_asked_with_a_card_and_a_verification_that_say_so(configless, tmp_path):
    summary = run(configless, "-o", "out", "-q", "--device", "cpu", "--allow-no-config")
    assert summary.startswith("out: 39 tensors")
    out = tmp_path / "out"
    tokenizer = ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    assert sorted(path.name for path in out.iterdir()) == [
        "README.md",
        "generation_config.json",
        "model.safetensors",
        *tokenizer,
    ]
    card = (out / "README.md").read_text()
    assert "quantization_config" not in card  # it said config.json no longer had one
    assert "There is no `config.json`: the source had none" in card
    assert "nf4convert src --dtype bf16 --allow-no-config -o out\n" in card
    lines = run("verify", "out", configless, "-q", "--device", "cpu").splitlines()
    assert lines[-2] == (
        "  note: config.json: the source has none and the output neither, so transformers cannot load the output as "
        "a model; the shapes it would load and its Conv1D layers were not checked"
    )
    assert lines[-1] == f"OK: bit-exact with {CPU_REFERENCE}"
    batch = run("batch", configless, "-o", "root", "-q", "--device", "cpu", "--allow-no-config")
    assert "ok" in batch.splitlines()[1].split() and not (tmp_path / "root" / "src-bf16" / "config.json").exists()


def test_a_converted_card_is_titled_by_the_output_and_shows_the_local_source_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(EXAMPLE, tmp_path / "tiny-bnb-4bit")
    run("./tiny-bnb-4bit", "-o", "tiny-dense", "-q", "--device", "cpu")
    card = (tmp_path / "tiny-dense" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n---\n\n# tiny-dense\n\n## How these weights were made")
    assert "\nnf4convert ./tiny-bnb-4bit --dtype bf16 -o tiny-dense\n" in card and "config.json` no longer has" in card
