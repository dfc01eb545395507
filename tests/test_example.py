"""The example in examples/: what make_example.py makes (its tokenizer byte for byte), small, and enough for a newcomer
to write a GGUF of it and to generate text with the converted model (random text: the weights are random)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from nf4convert.cli.commands import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE = EXAMPLES / "tiny-llama-bnb-4bit"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def test_the_example_ships_the_tokenizer_make_example_trains(tmp_path):
    pytest.importorskip("sentencepiece")
    spec = importlib.util.spec_from_file_location("make_example", EXAMPLES / "make_example.py")
    make_example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_example)
    vocab_size = json.loads((EXAMPLE / "config.json").read_text())["vocab_size"]
    make_example.save_tokenizer(tmp_path, vocab_size)
    for name in TOKENIZER_FILES:
        assert (tmp_path / name).read_bytes() == (EXAMPLE / name).read_bytes(), name
    assert sum((EXAMPLE / name).stat().st_size for name in TOKENIZER_FILES) < 300_000  # a small download
    vocabulary = json.loads((EXAMPLE / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(vocabulary) == vocab_size  # the model's rows, each a token


def test_the_example_converts_to_a_gguf_and_generates_text(tmp_path):
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("conversion")  # the "gguf" extra: llama.cpp's converter
    from transformers import AutoModelForCausalLM, AutoTokenizer

    runner = CliRunner()
    made = runner.invoke(main, [str(EXAMPLE), "-o", str(tmp_path / "x.gguf"), "-q", "--device", "cpu", "--verify"])
    assert made.exit_code == 0 and "\nOK: bit-exact with llama.cpp's converter" in made.stdout, made.output
    fields = gguf.GGUFReader(tmp_path / "x.gguf").fields
    assert fields["tokenizer.ggml.model"].contents() == "llama" and len(fields["tokenizer.ggml.tokens"].data) == 2048

    dense = tmp_path / "dense"
    assert runner.invoke(main, [str(EXAMPLE), "-o", str(dense), "-q", "--device", "cpu"]).exit_code == 0
    tokenizer = AutoTokenizer.from_pretrained(dense)
    model = AutoModelForCausalLM.from_pretrained(dense)
    prompt = tokenizer("kalo mine", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 8
    text = tokenizer.decode(generated[0], skip_special_tokens=True)
    assert text.startswith("kalo mine") and len(text) > len("kalo mine"), text


def test_make_format_examples_builds_a_checkpoint_of_each_format_it_names(tmp_path):
    """README's way to try the other formats: each folder a checkpoint that converts and verifies as its format."""
    pytest.importorskip("compressed_tensors")
    from nf4convert.formats.base import all_formats

    spec = importlib.util.spec_from_file_location("make_format_examples", EXAMPLES / "make_format_examples.py")
    made = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(made)
    made.main(tmp_path)
    methods = {method for source_format in all_formats().values() for method in source_format.quant_methods}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(made.EXAMPLES)
    for folder in tmp_path.iterdir():
        quantization = json.loads((folder / "config.json").read_text())["quantization_config"]
        assert quantization["quant_method"] in methods, folder.name
    runner = CliRunner()
    result = runner.invoke(main, [str(tmp_path / "gptq-4bit"), "-o", str(tmp_path / "out"), "-q", "--device", "cpu"])
    assert result.exit_code == 0, result.output
