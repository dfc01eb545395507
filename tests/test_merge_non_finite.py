"""An adapter merge that makes NaN or ±inf values the base does not hold (a NaN in a lora_B, factors whose product
overflows) is refused in one line naming the adapter and the tensor, in every dtype, unless --allow-non-finite: then
the values are written as peft makes them and a warning names the tensors. verify fails such an output either way."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from nf4convert.cli.commands import main

from fixtures.adapters import make_adapter
from fixtures.checkpoints import build

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")
TARGET = "model.layers.0.self_attn.q_proj"


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output + result.stderr
    return result


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build(tmp_path_factory.mktemp("non-finite") / "llama-bnb-4bit", "llama-nf4-dq", seed=7)


def _poisoned(folder, how: str):
    """The linear adapter with one module's factors made to give NaN (one NaN in lora_B) or ±inf (lora_A and lora_B
    whose product exceeds fp32's range) where the base is finite."""
    from safetensors.torch import load_file, save_file

    make_adapter(folder, "linear", seed=3)
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    a, b = (f"base_model.model.{TARGET}.lora_{x}.weight" for x in "AB")
    if how == "nan":
        tensors[b][5, 1] = float("nan")
    else:
        tensors[a] = torch.full_like(tensors[a], 10.0)
        tensors[b] = torch.full_like(tensors[b], 3e38 if tensors[b].dtype == torch.float32 else 1e38)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("how", ["nan", "inf"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp16"])
def test_a_merge_that_makes_nan_or_inf_is_refused_naming_the_tensor(tmp_path, base, how, dtype):
    # silent in bf16 and fp32; in fp16 a warning whose advice ("use bf16 or fp32") was wrong for a broken adapter
    adapter = _poisoned(tmp_path / "adapter", how)
    result = run(base, "--adapter", adapter, "-o", tmp_path / "out", "-q", "--device", "cpu", "--dtype", dtype, code=1)
    (line,) = result.stderr.strip().splitlines()
    made = "NaN values" if how == "nan" else "±inf values"
    assert line.startswith(f"Error: {adapter / 'adapter_model.safetensors'}: merging it makes "), line
    assert f"{made} in '{TARGET}.weight' that the base does not hold (" in line, line
    assert line.endswith("a model with them is broken (--allow-non-finite writes them anyway)"), line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["adapter"]


@pytest.mark.parametrize("how", ["nan", "inf"])
def test_kept_as_asked_they_are_peft_s_values_named_in_a_warning_and_verify_fails_them(tmp_path, base, how):
    adapter = _poisoned(tmp_path / "adapter", how)
    out = tmp_path / "out"
    result = run(
        base, "--adapter", adapter, "-o", out, "-q", "--device", "cpu", "--dtype", "bf16", "--allow-non-finite"
    )
    (warning,) = result.stderr.strip().splitlines()
    assert warning.startswith("Warning: the adapter's merge made NaN or ±inf values the base does not hold, kept")
    assert f"{TARGET}.weight (" in warning
    # the values are peft's own: every other tensor verifies, and this one is named for what the merge made
    lines = run("verify", out, base, "--adapter", adapter, "-q", "--device", "cpu", code=1).stdout.splitlines()
    problems = [line for line in lines if line.startswith("  MISMATCH")]
    assert len(problems) == 1 and problems[0].startswith(f"  MISMATCH {TARGET}.weight: the merge made "), lines
    assert problems[0].endswith("values that the base does not hold (a model with them is broken)")
    assert lines[-1] == "FAILED: 1 problem"
    from safetensors.torch import load_file

    merged = {}
    for shard in sorted(out.glob("*.safetensors")):
        merged.update(load_file(shard))
    values = merged[f"{TARGET}.weight"]
    assert (torch.isnan(values).any() if how == "nan" else torch.isinf(values).any()).item()
    assert all(torch.isfinite(value.float()).all() for name, value in merged.items() if not name.startswith(TARGET))


def test_a_finite_merge_is_untouched(tmp_path, base):
    adapter = make_adapter(tmp_path / "adapter", "linear", seed=3)
    result = run(base, "--adapter", adapter, "-o", tmp_path / "out", "-q", "--device", "cpu", "--dtype", "bf16")
    assert result.stderr == ""
    assert (
        "OK: bit-exact" in run("verify", tmp_path / "out", base, "--adapter", adapter, "-q", "--device", "cpu").stdout
    )


def test_only_values_the_base_does_not_hold_count():
    from nf4convert.adapters.finite import made, non_finite

    generator = torch.Generator().manual_seed(11)
    base = torch.randn(37, 29, generator=generator).to(torch.bfloat16)
    assert non_finite(base) is None
    base[3, 4], base[7, 0] = float("nan"), float("inf")
    before = non_finite(base)
    merged = base.clone() + 1
    assert made(merged, before) == (0, 0)  # the base's own, carried through
    merged[10, 10], merged[11, 11], merged[12, 12] = float("nan"), float("-inf"), float("inf")
    assert made(merged, before) == (1, 2)
    assert made(merged, None) == (2, 3)  # a saved weight replacing the base: all of them are the adapter's


@pytest.mark.parametrize("how", ["nan"])
def test_a_gguf_of_such_a_merge_is_refused_and_verify_fails_the_kept_one(tmp_path, base, how):
    pytest.importorskip("conversion")
    from fixtures.trained_tokenizers import sentencepiece_tokenizer

    source = tmp_path / "src"
    shutil.copytree(base, source)
    sentencepiece_tokenizer(source)
    config = json.loads((source / "config.json").read_text())
    assert config["model_type"] == "llama"
    adapter = _poisoned(tmp_path / "adapter", how)
    out = tmp_path / "out.gguf"
    line = run(source, "--adapter", adapter, "-o", out, "-q", "--device", "cpu", "--gguf-type", "bf16", code=1).stderr
    assert "merging it makes" in line and f"in '{TARGET}.weight'" in line and not out.exists()
    run(source, "--adapter", adapter, "-o", out, "-q", "--device", "cpu", "--gguf-type", "bf16", "--allow-non-finite")
    lines = run("verify", out, source, "--adapter", adapter, "-q", "--device", "cpu", code=1).stdout.splitlines()
    assert f"  MISMATCH {TARGET}.weight: the merge made " in "\n".join(lines) and lines[-1] == "FAILED: 1 problem"
