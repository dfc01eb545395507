"""LoRA adapters merged into FP8, compressed-tensors FP8 and MXFP4 bases, bit for bit as peft's ``merge_and_unload``
on the base transformers dequantizes (``dequantize=True``), LoRA on gpt-oss's fused expert parameters
(``target_parameters``, peft's ``ParamWrapper``) included; the merged model's logits those of the unmerged adapter
model within the merge's rounding; verify recomputes the merge with peft; what peft's parameter wrapper would not
merge so is refused in one line."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fixtures import float_checkpoints as fc
from fixtures.cli import cli, one_error_line

pytest.importorskip("peft")
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
FP8_CASES = ["qwen3-fp8-block32-f32", "qwen3-ct-fp8-channel", "qwen3-ct-fp8-block"]


def reference_load(source: Path, dtype: torch.dtype):
    """The base as transformers dequantizes it (``dequantize=True``) in ``dtype``."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config, Mxfp4Config

    method = json.loads((source / "config.json").read_text())["quantization_config"]["quant_method"]
    config = {"mxfp4": Mxfp4Config, "fp8": FineGrainedFP8Config}.get(method, CompressedTensorsConfig)(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(source, quantization_config=config, dtype=dtype).eval()


def _logits(model) -> torch.Tensor:
    ids = torch.tensor([[1, 5, 77, 300, 2, 9, 120, 45, 8, 3, 250, 17]])
    with torch.no_grad():
        return model(ids).logits.float()


def check_merge(source: Path, adapter: Path, out: Path) -> None:
    """Ours from SOURCE --adapter ADAPTER equals peft's merge on transformers' dequantized base, tensor for tensor, in
    bf16 and fp32; so do the logits of the output transformers loads; in fp32 the merged logits are the unmerged
    adapter model's within the merge's rounding; verify says all this with peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for flag, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        folder = out / flag
        cli(source, "--adapter", adapter, "-o", folder, "--dtype", flag, "--device", "cpu", "-q")
        peft_model = PeftModel.from_pretrained(reference_load(source, dtype), adapter)
        unmerged = _logits(peft_model)
        merged = peft_model.merge_and_unload()
        ours = fc.read_state(folder)
        state = merged.state_dict()
        assert ours.keys() == state.keys()
        for name, value in state.items():
            assert value.dtype == dtype and torch.equal(ours[name].view(BITS[dtype]), value.view(BITS[dtype])), name
        mine, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert mine.dtype == dtype and all(not keys for keys in info.values()), info
        logits = _logits(mine.eval())
        assert torch.equal(logits, _logits(merged))
        if dtype == torch.float32:  # bf16 forwards differ from each other by more than a merge's rounding
            assert (logits - unmerged).abs().max() <= 1e-4 * unmerged.abs().max()
        report = cli("verify", folder, source, "--adapter", adapter, "--device", "cpu")
        assert "OK: bit-exact" in report and "+ peft" in report


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss-adapters")
    return fc.build_mxfp4(root / "gpt-oss", seed=2)


def test_lora_on_gpt_oss_experts_and_attention(gpt_oss, tmp_path):
    adapter = fc.make_adapter(
        tmp_path / "adapter",
        "gpt-oss",
        seed=2,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        rank_pattern={"layers.1.mlp.experts.down_proj": 2},
        alpha_pattern={"gate_up_proj": 5},
    )
    check_merge(gpt_oss, adapter, tmp_path / "out")


def test_lora_on_one_expert_parameter_alone(gpt_oss, tmp_path):
    adapter = fc.make_adapter(
        tmp_path / "adapter",
        "gpt-oss",
        seed=2,
        r=3,
        lora_alpha=6,
        use_rslora=True,
        target_modules=[],
        target_parameters=["down_proj"],
    )
    check_merge(gpt_oss, adapter, tmp_path / "out")


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None, reason="needs compressed-tensors")
@pytest.mark.parametrize("variant", FP8_CASES)
def test_lora_on_fp8_bases(variant, tmp_path):
    if variant in fc.FP8_VARIANTS:
        source = fc.build_fp8(tmp_path / "source", variant, seed=4)
    else:
        source = fc.build_compressed(tmp_path / "source", variant, seed=4)
    arch = (fc.FP8_VARIANTS.get(variant) or fc.COMPRESSED_VARIANTS[variant])[0]
    adapter = fc.make_adapter(
        tmp_path / "adapter", arch, seed=4, r=8, lora_alpha=16, target_modules=["q_proj", "down_proj", "up_proj"]
    )
    check_merge(source, adapter, tmp_path / "out")


def _edited_config(adapter: Path, **changes) -> Path:
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(changes)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    return adapter


@pytest.mark.parametrize(
    "changes,expected",
    [
        ({"use_dora": True}, "target_parameters with use_dora True: peft's parameter wrapper refuses it"),
        ({"lora_dropout": 0.1}, "target_parameters with lora_dropout 0.1"),
        ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "lies inside 1 parameter wrappers"),
        (
            {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.router.weight"]},
            "target_parameters names 'model.layers.0.mlp.router.weight', but the adapter has no LoRA tensors for it",
        ),
        ({"r": 3}, "do not fit the base's 'model.layers.0.mlp.experts.gate_up_proj' [4, 64, 192] at rank 3"),
    ],
)
def test_what_peft_would_not_merge_so_is_refused(gpt_oss, tmp_path, changes, expected):
    adapter = fc.make_adapter(
        tmp_path / "adapter",
        "gpt-oss",
        seed=3,
        r=2,
        target_modules=[],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    _edited_config(adapter, **changes)
    out = tmp_path / "out"
    line = one_error_line(cli(gpt_oss, "--adapter", adapter, "-o", out, "--device", "cpu", "-q", code=1))
    assert expected in line and not out.exists(), line
