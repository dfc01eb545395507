"""``-o x.gguf --gguf-type T`` for llama-quantize's types writes the very file llama.cpp's own ``llama-quantize IN
x.gguf T`` writes (built from the pinned sdist: tests/fixtures/llama_cpp.py), IN being this tool's own GGUF of the
same source in the model's dtype: every type, with and without an importance matrix (GGUF and legacy formats), on a
Llama whose rows are whole super-blocks, one whose rows are not (the fallbacks), a tied-embedding Qwen2 and a
Mixtral (3-D experts); the embedding and head hold all-zero, constant, all-negative, outlier and tiny rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from nf4convert.sinks.gguf.converter import QUANT_TYPES

from fixtures.cli import invoke as cli
from fixtures.cli import one_error_line
from fixtures.kquant_models import build_model, imatrix_shapes, write_imatrix_dat, write_imatrix_gguf
from fixtures.llama_cpp import LlamaCpp

pytest.importorskip("conversion")  # the "gguf" extra: llama.cpp's converter
gguf = pytest.importorskip("gguf")

TYPES = list(QUANT_TYPES)
MODELS = ("llama-256", "llama-ragged", "qwen2-tied", "mixtral")


@pytest.fixture(scope="module")
def ref():
    return LlamaCpp.ready()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (source, this tool's GGUF of it in its own dtype, a GGUF imatrix, a legacy one), built once."""
    root = tmp_path_factory.mktemp("kquant")
    made = {}
    for seed, kind in enumerate(MODELS):
        source = build_model(root / kind / f"{kind}-bnb-4bit", kind, seed=seed)
        base = root / kind / "in.gguf"
        cli(source, "-o", base, "-q", "--device", "cpu")
        shapes = imatrix_shapes(base)
        matrices = root / kind
        made[kind] = (
            source,
            base,
            write_imatrix_gguf(matrices / "imatrix.gguf", shapes, seed=seed),
            write_imatrix_dat(matrices / "imatrix.dat", shapes, seed=seed),
        )
    return made


def _first_difference(a: bytes, b: bytes) -> str:
    at = next((index for index, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{len(a)} and {len(b)} bytes, first difference at byte {at}"


def _same_file(ours: Path, theirs: Path) -> None:
    a, b = ours.read_bytes(), theirs.read_bytes()
    if a != b:
        want, got = gguf.GGUFReader(theirs), gguf.GGUFReader(ours)
        assert list(got.fields) == list(want.fields)
        for x, y in zip(want.tensors, got.tensors):
            assert (y.name, y.tensor_type, list(y.shape)) == (x.name, x.tensor_type, list(x.shape))
            assert y.data.tobytes() == x.data.tobytes(), x.name
        raise AssertionError(_first_difference(a, b))


def _convert_and_quantize(ref, models, kind, gguf_type, tmp_path, imatrix=None):
    source, base, *_ = models[kind]
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    options = ["--imatrix", imatrix] if imatrix is not None else []
    cli(source, "-o", ours, "--gguf-type", gguf_type, *options, "-q", "--device", "cpu")
    ref.quantize_file(base, theirs, gguf_type, imatrix)
    return ours, theirs


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("gguf_type", TYPES)
def test_the_file_is_llama_quantizes(ref, models, kind, gguf_type, tmp_path):
    _same_file(*_convert_and_quantize(ref, models, kind, gguf_type, tmp_path))


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("gguf_type", TYPES)
def test_with_an_importance_matrix_the_file_is_llama_quantizes(ref, models, kind, gguf_type, tmp_path):
    imatrix = models[kind][2 if TYPES.index(gguf_type) % 3 else 3]  # the GGUF format, and the legacy one
    _same_file(*_convert_and_quantize(ref, models, kind, gguf_type, tmp_path, imatrix))


def test_the_type_name_is_case_insensitive_and_the_metadata_is_llama_quantizes(ref, models, tmp_path):
    ours, _ = _convert_and_quantize(ref, models, "llama-256", "Q4_K_M", tmp_path, models["llama-256"][2])
    fields = gguf.GGUFReader(ours).fields
    assert list(fields)[-6:] == [
        "general.quantization_version",
        "general.file_type",
        "quantize.imatrix.file",
        "quantize.imatrix.dataset",
        "quantize.imatrix.entries_count",
        "quantize.imatrix.chunks_count",
    ]
    assert fields["general.file_type"].contents() == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M


def test_a_dry_run_says_each_tensors_type_and_the_files_size(ref, models, tmp_path):
    source, *_ = models["llama-ragged"]
    out = tmp_path / "x.gguf"
    shown = cli(source, "-o", out, "--gguf-type", "q4_k_m", "--dry-run", "--device", "cpu").output
    assert not out.exists()
    cli(source, "-o", out, "--gguf-type", "q4_k_m", "-q", "--device", "cpu")
    assert f"GGUF file: {out.stat().st_size} bytes" in shown
    for tensor in gguf.GGUFReader(out).tensors:
        line = next(line for line in shown.splitlines() if line.split()[:1] == [tensor.name])
        assert line.endswith(f"-> {tensor.tensor_type.name}"), line


def test_an_importance_matrix_of_another_model_is_one_line(models, tmp_path):
    source, _, imatrix, _ = models["llama-256"]
    other = models["llama-ragged"][2]  # the same names, other lengths
    result = cli(source, "-o", tmp_path / "x.gguf", "--gguf-type", "q4_k_m", "--imatrix", other, code=2)
    assert "has 160 values, the tensor 256" in one_error_line(result.output)
    stranger = write_imatrix_gguf(tmp_path / "stranger.gguf", {"blk.0.mixer.weight": (256, 1)})
    result = cli(source, "-o", tmp_path / "x.gguf", "--gguf-type", "q4_k_m", "--imatrix", stranger, code=2)
    assert "names a tensor of this model" in one_error_line(result.output)
    (tmp_path / "broken.dat").write_bytes(b"\x02\0\0\0\x05\0\0\0blk")
    result = cli(
        source, "-o", tmp_path / "x.gguf", "--gguf-type", "q4_k_m", "--imatrix", tmp_path / "broken.dat", code=2
    )
    assert "not an importance matrix" in one_error_line(result.output)
    result = cli(source, "-o", tmp_path / "x.gguf", "--imatrix", imatrix, code=2)
    assert "--gguf-type" in one_error_line(result.output)
    assert not (tmp_path / "x.gguf").exists()


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0x10]))


def test_verify_makes_it_again_with_llama_quantize_and_catches_a_flipped_byte(ref, models, tmp_path, monkeypatch):
    monkeypatch.setenv("NF4CONVERT_LLAMA_QUANTIZE", str(ref.llama_quantize))
    source, _, imatrix, _ = models["mixtral"]
    out = tmp_path / "x.gguf"
    cli(source, "-o", out, "--gguf-type", "q4_k_m", "--imatrix", imatrix, "-q", "--device", "cpu")
    result = cli("verify", out, source, "-q", "--device", "cpu")
    assert "\nOK: bit-exact with llama.cpp's converter and quantizer on " in result.stdout
    tensor = next(t for t in gguf.GGUFReader(out).tensors if t.name == "blk.1.ffn_down_exps.weight")
    _flip(out, tensor.data_offset + tensor.n_bytes // 2)
    result = cli("verify", out, source, "-q", "--device", "cpu", code=1)
    assert "MISMATCH blk.1.ffn_down_exps.weight: 1 of" in result.stdout and "FAILED: 1 problem" in result.stdout


def test_verify_without_llama_cpp_says_how_to_get_it(models, tmp_path, monkeypatch):
    import sys

    source = models["llama-256"][0]
    out = tmp_path / "x.gguf"
    cli(source, "-o", out, "--gguf-type", "q5_k_s", "-q", "--device", "cpu")
    monkeypatch.delenv("NF4CONVERT_LLAMA_QUANTIZE", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not importable
    result = cli("verify", out, source, "-q", "--device", "cpu", code=1)
    line = one_error_line(result.output)
    assert "needs llama.cpp's own quantizer" in line and "llama-quantize" in line and "llama-cpp-python" in line
