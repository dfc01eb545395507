"""A failed verify of a folder says, beneath its findings, what they suggest: an output not made from that SOURCE
(its norms differ too, or its tensors are another model's), or an adapter merged in but not named."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nf4convert.verification.hints import not_from_source

from fixtures.cli import cli

pytest.importorskip("bitsandbytes")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"


def _another_model(folder: Path, seed: int) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(EXAMPLE, folder)
    generator = torch.Generator().manual_seed(seed)
    for shard in folder.glob("*.safetensors"):
        tensors = load_file(shard)
        for name, tensor in tensors.items():
            if name.endswith("norm.weight"):
                tensors[name] = (tensor.float() * torch.rand(tensor.shape, generator=generator)).to(tensor.dtype)
        save_file(tensors, shard, metadata={"format": "pt"})
    return folder


def test_verify_against_another_model_says_the_output_was_not_made_from_it(tmp_path):
    cli(EXAMPLE, "-o", tmp_path / "out", "-q", "--device", "cpu")
    other = _another_model(tmp_path / "other-bnb-4bit", seed=1)
    said = cli("verify", tmp_path / "out", other, "--device", "cpu", "-q", code=1)
    assert "FAILED" in said and "this output was not made from that source" in said, said
    assert "looks merged" not in said
    assert "OK: bit-exact" in cli("verify", tmp_path / "out", EXAMPLE, "--device", "cpu", "-q")


def test_an_output_of_other_tensors_is_not_from_the_source():
    expected = {f"layers.{i}.weight": (8, 8) for i in range(6)} | {"norm.weight": (8,)}
    assert not_from_source(expected, dict(expected), []) is None
    others = {f"blocks.{i}.weight": (8, 8) for i in range(6)} | {"norm.weight": (8,)}
    assert "1 of the output's 7 tensors" in not_from_source(expected, others, [])
    resized = {name: (9,) * len(shape) for name, shape in expected.items()}
    assert not_from_source(expected, resized, []) is not None
    two_norms = expected | {"final_norm.weight": (8,)}
    assert not_from_source(two_norms, two_norms, ["norm.weight: 3 of 8 elements differ"]) is None  # one of two
    assert "2 of the 2 one-dimensional" in not_from_source(
        two_norms, two_norms, ["norm.weight: 3 of 8 elements differ", "final_norm.weight: 8 of 8 elements differ"]
    )
