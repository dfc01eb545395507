"""The type plan (nf4convert/sinks/gguf/typeplan.py) against llama.cpp's own snapshots of real models' plans
(tests/snapshots/*.schema in the pinned llama.cpp: for each file type, every tensor whose type is not the default),
read as data. Each model's tensors are rebuilt from the numbers its snapshot's header gives and the architecture's
tensor layout (llama.cpp's loader), shapes in ggml's order."""

from __future__ import annotations

import pytest

from nf4convert.sinks.gguf.typeplan import (
    FILE_TYPES,
    Hparams,
    PlanError,
    Tensor,
    allows_quantization,
    type_plan,
    weight_order,
)
from tests.fixtures.llama_cpp import LlamaCpp


@pytest.fixture(scope="module")
def snapshots():
    return LlamaCpp.ready().source / "tests" / "snapshots"


def parse_schema(text: str) -> dict[str, tuple[str, dict[str, str]]]:
    """ftype -> (default type, {tensor: type}) as test-quant-type-selection.cpp reads a snapshot."""
    sections, current = {}, None
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            name, default = line[1:].split("]")
            current = sections[name] = (default.strip().upper(), {})
            continue
        tensor, kind = line.rsplit(" ", 1)
        current[1][tensor] = kind.upper()
    return sections


def _dense(n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, n_vocab, tied=False):
    tensors = [Tensor("token_embd.weight", (n_embd, n_vocab), "BF16"), Tensor("output_norm.weight", (n_embd,), "F32")]
    if not tied:
        tensors.append(Tensor("output.weight", (n_embd, n_vocab), "BF16"))
    for i in range(n_layer):
        blk = f"blk.{i}."
        tensors += [
            Tensor(blk + "attn_norm.weight", (n_embd,), "F32"),
            Tensor(blk + "attn_q.weight", (n_embd, n_head * head_dim), "BF16"),
            Tensor(blk + "attn_k.weight", (n_embd, n_head_kv * head_dim), "BF16"),
            Tensor(blk + "attn_v.weight", (n_embd, n_head_kv * head_dim), "BF16"),
            Tensor(blk + "attn_output.weight", (n_head * head_dim, n_embd), "BF16"),
            Tensor(blk + "ffn_norm.weight", (n_embd,), "F32"),
            Tensor(blk + "ffn_gate.weight", (n_embd, n_ff), "BF16"),
            Tensor(blk + "ffn_up.weight", (n_embd, n_ff), "BF16"),
            Tensor(blk + "ffn_down.weight", (n_ff, n_embd), "BF16"),
        ]
    return tensors


def _gpt_oss():
    n_embd, n_ff, n_expert, head_dim, n_vocab = 2880, 2880, 128, 64, 201088
    tensors = [Tensor(name, (n_embd, n_vocab), "BF16") for name in ("token_embd.weight", "output.weight")]
    for i in range(36):
        blk = f"blk.{i}."
        tensors += [
            Tensor(blk + "attn_q.weight", (n_embd, 64 * head_dim), "BF16"),
            Tensor(blk + "attn_k.weight", (n_embd, 8 * head_dim), "BF16"),
            Tensor(blk + "attn_v.weight", (n_embd, 8 * head_dim), "BF16"),
            Tensor(blk + "attn_output.weight", (64 * head_dim, n_embd), "BF16"),
            Tensor(blk + "attn_sinks.weight", (64,), "F32"),
            Tensor(blk + "ffn_gate_inp.weight", (n_embd, n_expert), "F32"),
            Tensor(blk + "ffn_gate_exps.weight", (n_embd, n_ff, n_expert), "MXFP4"),
            Tensor(blk + "ffn_up_exps.weight", (n_embd, n_ff, n_expert), "MXFP4"),
            Tensor(blk + "ffn_down_exps.weight", (n_ff, n_embd, n_expert), "MXFP4"),
        ]
    return tensors


def _deepseek_v3():
    """DeepSeek-V3's layout (MLA with attn_k_b / attn_v_b, 3 dense layers, then 256 experts and a shared one)."""
    n_embd, n_vocab, n_head, n_expert = 7168, 129280, 128, 256
    tensors = [Tensor(name, (n_embd, n_vocab), "BF16") for name in ("token_embd.weight", "output.weight")]
    for i in range(61):
        blk = f"blk.{i}."
        tensors += [
            Tensor(blk + "attn_q_a.weight", (n_embd, 1536), "BF16"),
            Tensor(blk + "attn_q_a_norm.weight", (1536,), "F32"),
            Tensor(blk + "attn_q_b.weight", (1536, n_head * 192), "BF16"),
            Tensor(blk + "attn_kv_a_mqa.weight", (n_embd, 576), "BF16"),
            Tensor(blk + "attn_kv_a_norm.weight", (512,), "F32"),
            Tensor(blk + "attn_k_b.weight", (128, 512, n_head), "BF16"),
            Tensor(blk + "attn_v_b.weight", (512, 128, n_head), "BF16"),
            Tensor(blk + "attn_output.weight", (n_head * 128, n_embd), "BF16"),
        ]
        if i < 3:
            tensors += [
                Tensor(blk + "ffn_gate.weight", (n_embd, 18432), "BF16"),
                Tensor(blk + "ffn_up.weight", (n_embd, 18432), "BF16"),
                Tensor(blk + "ffn_down.weight", (18432, n_embd), "BF16"),
            ]
            continue
        tensors += [
            Tensor(blk + "ffn_gate_inp.weight", (n_embd, n_expert), "F32"),
            Tensor(blk + "exp_probs_b.bias", (n_expert,), "F32"),
            Tensor(blk + "ffn_gate_exps.weight", (n_embd, 2048, n_expert), "BF16"),
            Tensor(blk + "ffn_up_exps.weight", (n_embd, 2048, n_expert), "BF16"),
            Tensor(blk + "ffn_down_exps.weight", (2048, n_embd, n_expert), "BF16"),
            Tensor(blk + "ffn_gate_shexp.weight", (n_embd, 2048), "BF16"),
            Tensor(blk + "ffn_up_shexp.weight", (n_embd, 2048), "BF16"),
            Tensor(blk + "ffn_down_shexp.weight", (2048, n_embd), "BF16"),
        ]
    return tensors


MODELS = {
    "qwen3-0.6b": (Hparams("qwen3", 28, 16, 8), lambda: _dense(28, 1024, 3072, 16, 8, 128, 151936)),
    "qwen3-14b": (Hparams("qwen3", 40, 40, 8), lambda: _dense(40, 5120, 17408, 40, 8, 128, 151936)),
    "meta-llama-3.1-70b-instruct": (
        Hparams("llama", 80, 64, 8),
        lambda: _dense(80, 8192, 28672, 64, 8, 128, 128256),
    ),
    "gemma-3-4b-it": (Hparams("gemma3", 34, 8, 4), lambda: _dense(34, 2560, 10240, 8, 4, 256, 262144, tied=True)),
    "gpt-oss-120b": (Hparams("gpt-oss", 36, 64, 8, 128), _gpt_oss),
    "deepseek-v3.1": (Hparams("deepseek2", 61, 128, 1, 256), _deepseek_v3),
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_type_plan_matches_llama_cpp_snapshots(model, snapshots):
    hparams, build = MODELS[model]
    tensors = build()
    sections = parse_schema((snapshots / f"{model}.schema").read_text())
    assert set(sections) <= set(FILE_TYPES) and len(sections) >= 30
    quantized = [tensor for tensor in tensors if allows_quantization(tensor, hparams.arch)]
    for ftype, (default, overrides) in sections.items():
        assert FILE_TYPES[ftype][1] == default, ftype
        assert set(overrides) <= {tensor.name for tensor in quantized}, f"{ftype}: the snapshot names other tensors"
        plan = type_plan(tensors, hparams, ftype)
        wrong = {
            name: (plan[name], overrides.get(name, default))
            for name in (tensor.name for tensor in quantized)
            if plan[name] != overrides.get(name, default)
        }
        assert not wrong, f"{model} {ftype}: {len(wrong)} tensors differ, e.g. {sorted(wrong.items())[:3]}"
        kept = [tensor for tensor in tensors if not allows_quantization(tensor, hparams.arch)]
        assert all(plan[tensor.name] == tensor.type for tensor in kept)


def test_the_plan_reads_tensors_in_llama_quantize_order():
    """Counters run in llama-quantize's order (by layer, then name), whatever order the tensors come in: attn_v's
    use_more_bits layers of a 12-layer model are the same shuffled."""
    import random

    tensors = _dense(12, 256, 512, 4, 2, 64, 1000)
    hparams = Hparams("llama", 12, 4, 2)
    plan = type_plan(tensors, hparams, "Q4_K_M")
    shuffled = tensors[:]
    random.Random(7).shuffle(shuffled)
    assert type_plan(shuffled, hparams, "Q4_K_M") == plan
    more_bits = [i for i in range(12) if plan[f"blk.{i}.attn_v.weight"] == "Q6_K"]
    assert more_bits == [0, 3, 6, 9, 10, 11]  # i < 12/8, i >= 7*12/8, (i - 1) % 3 == 2
    assert weight_order(["blk.10.a", "blk.2.b", "output.weight", "blk.2.a"]) == [
        "output.weight",
        "blk.2.a",
        "blk.2.b",
        "blk.10.a",
    ]


def test_fallbacks_where_rows_are_not_multiples_of_the_block():
    """A row of 96 values takes Q4_K's fallback Q5_0, Q6_K's Q8_0; a row of 100 values (no 32-value block) is F16;
    an output whose row does not divide is Q8_0."""
    tensors = [
        Tensor("token_embd.weight", (96, 50), "BF16"),
        Tensor("output.weight", (96, 50), "BF16"),
        Tensor("blk.0.attn_q.weight", (96, 96), "BF16"),
        Tensor("blk.0.attn_k.weight", (100, 96), "BF16"),
        Tensor("blk.0.attn_v.weight", (96, 32), "BF16"),
        Tensor("blk.0.ffn_down.weight", (256, 96), "BF16"),
        Tensor("blk.0.attn_norm.weight", (96,), "F32"),
        Tensor("blk.0.single_row.weight", (256, 1), "BF16"),
    ]
    plan = type_plan(tensors, Hparams("llama", 1, 3, 1), "q4_k_m")
    assert plan == {
        "token_embd.weight": "Q5_0",
        "output.weight": "Q8_0",
        "blk.0.attn_q.weight": "Q5_0",
        "blk.0.attn_k.weight": "F16",
        "blk.0.attn_v.weight": "Q8_0",  # use_more_bits: Q6_K, whose fallback is Q8_0
        "blk.0.ffn_down.weight": "Q6_K",
        "blk.0.attn_norm.weight": "F32",
        "blk.0.single_row.weight": "BF16",  # one row: one dimension to ggml
    }


def test_an_expert_tensor_without_a_layer_is_refused():
    tensors = [Tensor("ffn_down_exps.weight", (256, 256, 8), "BF16")]
    with pytest.raises(PlanError, match="ffn_down_exps.weight"):
        type_plan(tensors, Hparams("llama", 2, 4, 4, 8), "Q4_K_M")
