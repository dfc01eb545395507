"""GGUF from FP8, compressed-tensors FP8 and MXFP4 sources: ``nf4convert SOURCE -o x.gguf`` writes the file llama.cpp's
converter writes from the dense output of ``nf4convert SOURCE``, field by field and byte by byte (as tests/test_gguf.py
checks for bitsandbytes sources), for gpt-oss (its dense experts: the converter splits gate_up_proj and transposes
them itself), Qwen3 with ragged FP8 blocks, and Llama with compressed-tensors FP8; with an adapter merged too."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from test_gguf import assert_same_gguf, cli, converter, dense, pre_tokenizer

from fixtures import float_checkpoints as fc
from fixtures.trained_tokenizers import byte_bpe_tokenizer, sentencepiece_tokenizer

pytest.importorskip("conversion")  # the "gguf" extra: llama.cpp's converter

# variant -> (tokenizer, BPE pre-tokenizer name (see tests/test_gguf.py))
CASES = {
    "gpt-oss": (byte_bpe_tokenizer, "gpt-2"),
    "qwen3-fp8-block128-bf16": (byte_bpe_tokenizer, "gpt-2"),
    "llama-ct-fp8-tensor": (sentencepiece_tokenizer, None),
}
DENSE_DTYPE = {"f16": "fp16", "bf16": "bf16", "q8_0": "auto"}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    variant = request.param
    if variant != "gpt-oss" and importlib.util.find_spec("compressed_tensors") is None:
        pytest.skip("needs compressed-tensors (the FP8 fixtures quantize with it)")
    root = tmp_path_factory.mktemp(variant)
    folder = root / "source" / f"tiny-{variant}"
    if variant == "gpt-oss":
        source = fc.build_mxfp4(folder, seed=6)
    elif variant in fc.FP8_VARIANTS:
        source = fc.build_fp8(folder, variant, seed=6)
    else:
        source = fc.build_compressed(folder, variant, seed=6)
    CASES[variant][0](source, vocab_size=384)  # the fixtures' models have 384 tokens
    return variant, source, root / "dense"


@pytest.mark.parametrize("outtype", ["bf16", "f16", "q8_0"])
def test_equals_converter_on_dense(checkpoint, outtype, tmp_path, monkeypatch):
    variant, source, dense_root = checkpoint
    pre_tokenizer(monkeypatch, CASES[variant][1])
    dense_folder = dense(source, dense_root, DENSE_DTYPE[outtype])
    expected = converter(dense_folder, outtype, tmp_path / "expected.gguf", monkeypatch)
    ours = tmp_path / "ours.gguf"
    cli(source, "-o", ours, "--gguf-type", outtype, "-q", "--device", "cpu")
    assert_same_gguf(expected, ours)


def test_with_an_adapter_on_the_experts(tmp_path, monkeypatch):
    source = fc.build_mxfp4(tmp_path / "source" / "tiny-gpt-oss", seed=7)
    byte_bpe_tokenizer(source, vocab_size=384)
    adapter = fc.make_adapter(
        tmp_path / "adapter",
        "gpt-oss",
        seed=7,
        r=2,
        target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    pre_tokenizer(monkeypatch, "gpt-2")
    dense_folder = dense(source, tmp_path / "dense", "bf16", "--adapter", adapter)
    expected = converter(dense_folder, "bf16", tmp_path / "expected.gguf", monkeypatch)
    ours = tmp_path / "ours.gguf"
    cli(source, "--adapter", adapter, "-o", ours, "--gguf-type", "bf16", "-q", "--device", "cpu")
    assert_same_gguf(expected, ours)
    assert Path(ours).stat().st_size == Path(expected).stat().st_size
