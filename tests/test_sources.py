"""Reading a source, as convert and verify both do: an adapter read once, whether it is SOURCE (standing for its base)
or given beside it; a plan's refusal worded once, by the planner, the same for the API, convert and verify."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nf4convert.adapters import lora
from nf4convert.errors import CheckpointError
from nf4convert.plan import make_plan

from fixtures.adapters import make_adapter
from fixtures.checkpoints import build
from fixtures.cli import cli, one_error_line


def test_an_adapter_is_read_once_as_source_or_beside_it(tmp_path, monkeypatch):
    base = build(tmp_path / "base-bnb-4bit", "llama-nf4-dq", seed=1)
    adapter = make_adapter(tmp_path / "lora", "linear", seed=2, base_model=str(base))
    reads = []
    read = lora.load_adapter
    monkeypatch.setattr(lora, "load_adapter", lambda folder: reads.append(Path(folder).resolve()) or read(folder))
    for args in ([base, "--adapter", adapter], [adapter]):
        reads.clear()
        planned = cli(*args, "-o", tmp_path / "out", "--dry-run", "--device", "cpu")
        assert "merged with the adapter" in planned, planned
        assert reads == [adapter.resolve()], (args, reads)


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None, reason="needs compressed-tensors")
def test_a_plan_refusal_is_worded_once_for_the_api_convert_and_verify(tmp_path):
    from fixtures import float_checkpoints as fc

    folder = fc.build_compressed(tmp_path / "ct-fp8", "qwen3-ct-fp8-block")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "group"
    (folder / "config.json").write_text(json.dumps(config))
    expected = f"{folder}: config group 'group_0' quantizes FP8 weights by strategy 'group', not read yet"
    with pytest.raises(CheckpointError) as refused:
        make_plan(folder)
    assert str(refused.value) == expected
    assert one_error_line(cli(folder, "-o", tmp_path / "out", "--dry-run", code=1)) == f"Error: {expected}"
    output = tmp_path / "output"
    output.mkdir()
    save_file({"lm_head.weight": torch.zeros(2, 2, dtype=torch.bfloat16)}, output / "model.safetensors")
    shutil.copy(folder / "config.json", output / "config.json")
    line = one_error_line(cli("verify", output, folder, "--device", "cpu", "-q", code=1))
    assert line == f"Error: {expected}"
