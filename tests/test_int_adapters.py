"""Adapters trained on GPTQ, AWQ and compressed-tensors bases, merged while converting: every tensor bit for bit what
peft's ``merge_and_unload()`` makes on the reference-dequantized base loaded as a dense model (peft itself refuses to
merge into GPTQ and AWQ layers: the dequantized base is what was trained on), verify --adapter accepts it, and the
merged model's logits are the unmerged adapter model's within the merge's rounding."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file

from fixtures.adapters import ATTENTION, make_adapter, peft_merged
from fixtures.cli import cli
from fixtures.int_checkpoints import build, reference_dense
from fixtures.weights import bits

pytest.importorskip("peft")
pytest.importorskip("compressed_tensors")
warnings.filterwarnings("ignore", module="peft")

BASES = ["gptq-llama-4bit-g32-v1-asym-descact", "awq-llama-gemm-g32", "ct-llama-w4a16-g32-asym-ignore"]
ADAPTERS = {  # LoraConfig arguments: LoRA, DoRA and rsLoRA, each on a few of the quantized layers and the others
    "lora": dict(r=4, lora_alpha=8, target_modules=[*ATTENTION, "gate_proj", "up_proj", "down_proj"]),
    "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "rslora": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["k_proj", "o_proj", "up_proj"]),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Each base, and its reference-dequantized checkpoint written dense."""
    root = tmp_path_factory.mktemp("int-adapter-bases")
    made = {}
    for index, variant in enumerate(BASES):
        source = build(root / variant, variant, seed=30 + index).folder
        made[variant] = source, reference_dense(source, root / f"{variant}-reference")
    return made


@pytest.mark.parametrize("adapter_kind", list(ADAPTERS))
@pytest.mark.parametrize("variant", BASES)
def test_merged_equals_peft_on_the_reference_dequantized_base(bases, variant, adapter_kind, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    source, reference = bases[variant]
    seed = 50 + 3 * BASES.index(variant) + list(ADAPTERS).index(adapter_kind)
    adapter = make_adapter(tmp_path / "adapter", adapter_kind, seed=seed, config=ADAPTERS[adapter_kind])
    out = tmp_path / "merged"
    cli(source, "--adapter", adapter, "-o", out, "-q", "--device", "cpu", "--max-shard-size", "400KB")
    merged = {}
    for shard in out.glob("*.safetensors"):
        merged.update(load_file(shard))
    expected = peft_merged(reference, adapter).state_dict()
    dense = load_file(reference / "model.safetensors")
    assert set(merged) == set(dense)
    changed = 0
    for name, tensor in merged.items():
        assert torch.equal(bits(tensor), bits(expected[name].contiguous())), name
        changed += not torch.equal(bits(tensor), bits(dense[name]))
    assert changed >= 6
    assert "OK: bit-exact" in cli("verify", out, source, "--adapter", adapter, "--device", "cpu", "-q")

    # The merged model computes what the adapter model computed unmerged on the base it was trained on, but for the
    # rounding of each merged weight to the model's dtype.
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits.float()
        base = AutoModelForCausalLM.from_pretrained(reference)
        unmerged = PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids).logits.float()
        plain = AutoModelForCausalLM.from_pretrained(reference).eval()(input_ids=ids).logits.float()
    difference, change = (ours - unmerged).abs().max(), (unmerged - plain).abs().max()
    assert change > 0.05 and difference < 0.1 * change, (difference, change)
