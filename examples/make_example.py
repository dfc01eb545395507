"""Build the example checkpoint shipped in examples/tiny-llama-bnb-4bit (a few MB), on the CPU.

A small Llama-shaped model with random weights, quantized by transformers + bitsandbytes exactly as
the Hub's *-bnb-4bit checkpoints are (NF4, double quantization, bf16 compute dtype), and saved in three
shards so that some quant-state keys sit in another shard than their packed weight. Its tokenizer is a
Llama-style SentencePiece BPE (byte fallback, 2048 tokens, the model's vocabulary) trained here on made-up
sentences and saved as transformers saves it (tokenizer.model and tokenizer.json), so that the example
converts to GGUF and generates text (random text: the weights are random).

    python examples/make_example.py [OUT]      # needs sentencepiece (the "gguf" extra) for the tokenizer
"""

import io
import json
import random
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, LlamaConfig


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
    save_tokenizer(out, config.vocab_size)
    print(f"wrote {out}")


def save_tokenizer(out: Path, vocab_size: int) -> None:
    """Train the tokenizer (ids 0, 1, 2: <unk>, <s>, </s>, as LlamaConfig's defaults say) and save it into ``out``."""
    import sentencepiece as spm

    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "su", "ta", "ri", "po", "an", "el", "or", "us", "th", "qu", "ba", "de"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(2000)]
    sentences = [
        " ".join(rng.choices(words, k=rng.randint(5, 15))) + rng.choice([".", "!", "?", ", 12 34."])
        for _ in range(4000)
    ]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,  # as Llama's: any text encodes, a byte a token where no piece fits
        normalization_rule_name="identity",
        split_digits=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,  # the same pieces on every machine
        minloglevel=2,
    )
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "tokenizer.model").write_bytes(model.getvalue())
        special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "model_max_length": 512, **special}
        (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config))
        AutoTokenizer.from_pretrained(folder).save_pretrained(out)
    (out / "tokenizer.model").write_bytes(model.getvalue())


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "tiny-llama-bnb-4bit")
