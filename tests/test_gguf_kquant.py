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
    again = tmp_path / "again.gguf"  # --verify says so before anything is converted
    result = cli(source, "-o", again, "--gguf-type", "q5_k_s", "--verify", "-q", "--device", "cpu", code=1)
    assert one_error_line(result.output) == line and not again.exists()


def test_with_an_adapter_and_in_a_batch_the_files_are_llama_quantizes(ref, models, tmp_path):
    from fixtures.adapters import make_adapter
    from fixtures.checkpoints import build
    from fixtures.trained_tokenizers import sentencepiece_tokenizer

    source = build(tmp_path / "small-bnb-4bit", "llama-nf4-dq", seed=4)
    sentencepiece_tokenizer(source)
    adapter = make_adapter(tmp_path / "adapter", "linear", seed=6)
    base, ours, theirs = tmp_path / "in.gguf", tmp_path / "ours.gguf", tmp_path / "theirs.gguf"
    cli(source, "--adapter", adapter, "-o", base, "-q", "--device", "cpu")
    cli(source, "--adapter", adapter, "-o", ours, "--gguf-type", "q4_k_m", "-q", "--device", "cpu")
    _same_file(ours, ref.quantize_file(base, theirs, "q4_k_m"))

    kinds = ("llama-ragged", "qwen2-tied")
    cli("batch", *(models[kind][0] for kind in kinds), "-o", tmp_path / "batch", "--gguf-type", "q5_k_m", "-q")
    for kind in kinds:
        (made,) = (tmp_path / "batch").glob(f"{kind}*q5_k_m.gguf")
        _same_file(made, ref.quantize_file(models[kind][1], tmp_path / f"{kind}.gguf", "q5_k_m"))


@pytest.mark.parametrize("source_type", ["BF16", "F16", "F32"])
def test_rows_quantized_by_torch_are_numpys_bytes(source_type):
    import numpy as np

    from nf4convert.sinks.gguf.requant import Retyped

    rng = np.random.default_rng(3)
    values = rng.standard_normal((6, 512)).astype(np.float32)
    raw = {"BF16": values.view(np.uint32) >> 16, "F16": values.astype(np.float16), "F32": values}[source_type]
    raw = np.ascontiguousarray(raw.astype({"BF16": np.uint16}.get(source_type, raw.dtype))).reshape(-1).view(np.uint8)
    imatrix = rng.random(512 * 2).astype(np.float32)
    for target in ("Q4_K", "Q3_K", "IQ4_XS", "Q5_0"):
        plain = Retyped("x", (512, 3, 2, 1), source_type, target, imatrix)
        on_torch = Retyped("x", (512, 3, 2, 1), source_type, target, imatrix, device="cpu")
        assert np.array_equal(plain.quantize(raw[raw.size // 2 :], 3), on_torch.quantize(raw[raw.size // 2 :], 3))


@pytest.mark.gpu
def test_on_the_gpu_route_the_file_is_llama_quantizes(ref, models, tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for kind, gguf_type in (("llama-256", "q4_k_m"), ("mixtral", "q3_k_m")):
        source, base, imatrix, _ = models[kind]
        ours, theirs = tmp_path / f"{kind}.gguf", tmp_path / f"{kind}-ref.gguf"
        cli(source, "-o", ours, "--gguf-type", gguf_type, "--imatrix", imatrix, "-q", "--device", "cuda")
        _same_file(ours, ref.quantize_file(base, theirs, gguf_type, imatrix))


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_from_f16_and_f32_values_the_file_is_llama_quantizes(ref, models, tmp_path, dtype):
    source, _, imatrix, _ = models["llama-ragged"]
    base = tmp_path / "in.gguf"
    cli(source, "-o", base, "--dtype", dtype, "-q", "--device", "cpu")  # the f16 (f32) file llama-quantize reads
    for gguf_type in ("q4_k_m", "iq4_xs"):
        ours = tmp_path / f"{gguf_type}.gguf"
        cli(source, "-o", ours, "--dtype", dtype, "--gguf-type", gguf_type, "--imatrix", imatrix, "-q")
        _same_file(ours, ref.quantize_file(base, tmp_path / f"{gguf_type}-ref.gguf", gguf_type, imatrix))
