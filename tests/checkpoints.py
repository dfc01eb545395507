"""Real bitsandbytes 4-bit checkpoints, built on the CPU by transformers + bitsandbytes for the tests."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch


def _configs():
    from transformers import BertConfig, GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    small = dict(
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=512,
        max_position_embeddings=256,
    )
    return {
        "llama": lambda: LlamaConfig(**small, num_key_value_heads=2, tie_word_embeddings=False),
        "qwen2": lambda: Qwen2Config(**small, num_key_value_heads=2, tie_word_embeddings=True),
        "mistral": lambda: MistralConfig(**small, num_key_value_heads=2, tie_word_embeddings=False),
        "phi3": lambda: Phi3Config(**small, num_key_value_heads=4, pad_token_id=0, tie_word_embeddings=False),
        "bert": lambda: BertConfig(**small),
        # Conv1D layers (weights stored (in, out)), which transformers quantizes transposed
        "gpt2": lambda: GPT2Config(
            n_embd=128,
            n_inner=320,
            n_layer=2,
            n_head=4,
            vocab_size=512,
            n_positions=256,
            bos_token_id=0,
            eos_token_id=0,
        ),
    }


# name: (architecture, quant_type, double quant, quant storage, dense dtype, skipped modules)
VARIANTS = {
    "llama-nf4-dq": ("llama", "nf4", True, torch.uint8, torch.bfloat16, None),
    "qwen2-tied-fp4": ("qwen2", "fp4", False, torch.uint8, torch.float16, None),
    "mistral-skip-nf4": ("mistral", "nf4", True, torch.uint8, torch.bfloat16, ["down_proj", "lm_head"]),
    "phi3-fused-fp4-dq": ("phi3", "fp4", True, torch.uint8, torch.bfloat16, None),
    "bert-encoder-nf4": ("bert", "nf4", False, torch.uint8, torch.float32, None),
    "llama-bf16-storage": ("llama", "nf4", True, torch.bfloat16, torch.bfloat16, None),
    "gpt2-conv1d-nf4-dq": ("gpt2", "nf4", True, torch.uint8, torch.float16, None),
}


def model_class(arch: str):
    from transformers import AutoModel, AutoModelForCausalLM

    return AutoModel if arch == "bert" else AutoModelForCausalLM


def build(folder: Path, variant: str, *, shard_size: str = "150KB", seed: int = 0) -> Path:
    """Save the 4-bit checkpoint of ``variant`` into ``folder`` (sharded small, so quant keys split)."""
    from transformers import BitsAndBytesConfig

    arch, quant_type, double_quant, storage, dtype, skip = VARIANTS[variant]
    torch.manual_seed(seed)
    cls = model_class(arch)
    with tempfile.TemporaryDirectory() as dense:
        cls.from_config(_configs()[arch](), dtype=dtype).save_pretrained(dense)
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=quant_type,
            bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=storage,
            llm_int8_skip_modules=skip,
        )
        model = cls.from_pretrained(dense, quantization_config=quantization, dtype=dtype, device_map="cpu")
        model.save_pretrained(folder, max_shard_size=shard_size)
    move_quant_state(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "README.md").write_text("# test model\n")
    return folder


def move_quant_state(folder: Path) -> str:
    """Move one weight's quant-state tensors into a shard of their own (as a real sharded save can)."""
    from safetensors.torch import load_file, save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = index["weight_map"]
    state_key = next(k for k in sorted(weight_map) if ".quant_state.bitsandbytes__" in k)
    weight = state_key.split(".quant_state.")[0]
    moved = [k for k in weight_map if k.startswith(weight + ".") and k != weight]
    source = folder / weight_map[weight]
    tensors = load_file(source)
    save_file(
        {k: tensors.pop(k) for k in moved if k in tensors},
        folder / "model-quant-state.safetensors",
        metadata={"format": "pt"},
    )
    save_file(tensors, source, metadata={"format": "pt"})
    for key in moved:
        weight_map[key] = "model-quant-state.safetensors"
    index_path.write_text(json.dumps(index, indent=2))
    return weight
