"""What only this tool does, measured: transformers 5 cannot load the bitsandbytes 4-bit MoE and Falcon checkpoints that
transformers 4.x wrote (its experts fused, its Falcon layers left unquantized); nf4convert converts them bit for bit,
and transformers 5 loads the output, every weight where its model reads it."""

from __future__ import annotations

import random

import pytest
import torch
from click.testing import CliRunner

from nf4convert.cli.commands import main

from fixtures.checkpoints_v4 import build_v4
from fixtures.weights import bits, bnb_reference_cpu

pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5


def _dequantized(states, name):
    packed, state = states[name]
    return bnb_reference_cpu(packed, state)  # what bitsandbytes' CUDA kernels give


@pytest.mark.parametrize("arch", ["mixtral", "falcon"])
def test_a_transformers4_checkpoint_that_transformers5_cannot_load_converts_and_loads(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    source = tmp_path / f"{arch}-bnb-4bit"
    states = build_v4(source, arch, seed=random.randrange(1 << 30))
    if TRANSFORMERS_5:  # the claim README makes: transformers 5 itself cannot load the 4-bit checkpoint
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
            AutoModelForCausalLM.from_pretrained(source, device_map="cpu")

    out = tmp_path / f"{arch}-bf16"
    result = CliRunner().invoke(main, [str(source), "-o", str(out), "-q", "--device", "cpu", "--verify"])
    assert result.exit_code == 0 and "\nOK: bit-exact with" in result.stdout, result.output

    model, info = AutoModelForCausalLM.from_pretrained(out, device_map="cpu", output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.dtype == torch.bfloat16
    for layer in range(model.config.num_hidden_layers):
        if arch == "mixtral":
            experts = model.model.layers[layer].mlp.experts  # transformers 5's fused 3-D experts
            for expert in range(model.config.num_local_experts):
                prefix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
                gate_up = torch.cat([_dequantized(states, f"{prefix}.{w}.weight") for w in ("w1", "w3")])
                assert torch.equal(bits(experts.gate_up_proj[expert]), bits(gate_up))
                assert torch.equal(bits(experts.down_proj[expert]), bits(_dequantized(states, f"{prefix}.w2.weight")))
            loaded = model.model.layers[layer].self_attn.q_proj.weight
            assert torch.equal(
                bits(loaded), bits(_dequantized(states, f"model.layers.{layer}.self_attn.q_proj.weight"))
            )
        else:
            loaded = model.transformer.h[layer].self_attention.query_key_value.weight
            name = f"transformer.h.{layer}.self_attention.query_key_value.weight"
            assert torch.equal(bits(loaded), bits(_dequantized(states, name)))
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size) and torch.isfinite(logits).all()
