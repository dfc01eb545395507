"""Checkpoints that once converted into a wrong model with exit 0: each is kept right, or refused in one line naming
the tensor (or the setting), exit 1, nothing written, on every route (convert, a dry run, a GGUF output, batch, the
Hub); and verify of an output planted with the wrong values fails. Tiny checkpoints, built once, then each changed
in one way in a test's own folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fixtures.cli import cli
from fixtures.int_checkpoints import build

pytest.importorskip("compressed_tensors")

QWEN2_GPTQ = "gptq-qwen2-4bit-g64-v2-bf16"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """variant -> its checkpoint's folder, built on first use (read only: a test changes its own copy)."""
    root, folders = tmp_path_factory.mktemp("wrong-accepts"), {}

    def folder(variant: str) -> Path:
        if variant not in folders:
            folders[variant] = build(root / variant, variant).folder
        return folders[variant]

    return folder


def copy_of(built, variant: str, into: Path) -> Path:
    """A copy of ``variant``'s checkpoint in ``into``, for a test to change."""
    shutil.copytree(built(variant), into)
    return into


def edit_config(folder: Path, change) -> None:
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))


def edit_tensors(folder: Path, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})


# --- GPTQ biases -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("architectures", [True, False], ids=["architectures", "no-architectures"])
def test_gptq_q_k_v_biases_are_kept(built, tmp_path, architectures):
    """Qwen2's q/k/v projections have biases: every one is written as it is, with or without ``architectures`` in
    config.json (without it transformers builds the base model, whose layer names lack the head's prefix)."""
    source = copy_of(built, QWEN2_GPTQ, tmp_path / "source")
    if not architectures:
        edit_config(source, lambda config: config.pop("architectures"))
    biases = {name: value for name, value in load_file(source / "model.safetensors").items() if name.endswith(".bias")}
    assert len(biases) == 6  # q, k and v of two layers
    out = tmp_path / "out"
    cli(source, "-o", out, "-q", "--device", "cpu")
    made = load_file(out / "model.safetensors")
    for name, value in biases.items():
        assert name in made and torch.equal(made[name], value), name
    assert "OK: bit-exact" in cli("verify", out, source, "--device", "cpu", "-q")


def test_autogptq_zero_biases_of_layers_without_bias_are_still_left_out(built, tmp_path):
    """AutoGPTQ's zero biases beside Llama's projections (which have none) are not written, also where config.json
    has no ``architectures``."""
    source = copy_of(built, "gptq-llama-4bit-g32-v1-sym", tmp_path / "source")
    edit_config(source, lambda config: config.pop("architectures"))

    def add_zero_biases(tensors):
        for name in [name for name in tensors if name.endswith(".qweight")]:
            tensors[name.removesuffix("qweight") + "bias"] = torch.zeros(tensors[name].shape[1], dtype=torch.float16)

    edit_tensors(source, add_zero_biases)
    out = tmp_path / "out"
    cli(source, "-o", out, "-q", "--device", "cpu")
    assert not [name for name in load_file(out / "model.safetensors") if name.endswith(".bias")]


def test_verify_names_a_bias_the_output_lacks_that_the_source_holds(built, tmp_path, monkeypatch):
    """Where a conversion leaves out biases the source holds (planted: a plan that drops them, for the conversion
    and verify alike), verify says the source holds them and the output lacks them."""
    from nf4convert.formats import gptq

    source = built(QWEN2_GPTQ)

    def every_bias(weights, tensors, config):
        return {weight.name.removesuffix("weight") + "bias" for weight in weights} & set(tensors)

    monkeypatch.setattr(gptq, "unused_biases", every_bias)
    out = tmp_path / "out"
    cli(source, "-o", out, "-q", "--device", "cpu")
    report = cli("verify", out, source, "--device", "cpu", "-q", code=1)
    assert (
        "model.layers.0.self_attn.q_proj.bias: transformers' Qwen2ForCausalLM has this parameter and the source "
        "holds it ('model.layers.0.self_attn.q_proj.bias'), but the output lacks it" in report
    ), report
    assert "the source and the output lack" not in report
