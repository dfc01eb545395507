"""Build the example checkpoint shipped in examples/tiny-llama-bnb-4bit (a few MB), on the CPU.

A small Llama-shaped model with random weights, quantized by transformers + bitsandbytes exactly as
the Hub's *-bnb-4bit checkpoints are (NF4, double quantization, bf16 compute dtype), and saved in two
shards so that some quant-state keys sit in another shard than their packed weight.

    python examples/make_example.py [OUT]
"""

import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig


def main(out: Path) -> None:
    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    with tempfile.TemporaryDirectory() as dense:
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(dense)
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        model = AutoModelForCausalLM.from_pretrained(
            dense, quantization_config=quantization, dtype=torch.bfloat16, device_map="cpu"
        )
        model.save_pretrained(out, max_shard_size="2MB")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "tiny-llama-bnb-4bit")
