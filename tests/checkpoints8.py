"""Real bitsandbytes 8-bit (LLM.int8) checkpoints, built on the CPU by transformers + bitsandbytes for the tests.

The route is the users' own: ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_8bit=True),
device_map="cpu")`` then ``save_pretrained``. transformers 5.23 + bitsandbytes 0.50.2 quantize 8-bit on the
CPU (``Int8Params`` casts each weight to fp16 and calls ``int8_vectorwise_quant``, whose default kernel is
plain torch) and save what a GPU save writes: per quantized linear ``X.weight`` (I8 [out, in]), ``X.SCB``
(F32 [out]) and ``X.weight_format`` (U8 scalar 0, row-major); everything else dense in the source dtype;
``quantization_config`` with ``load_in_8bit`` in config.json. Nothing is simulated.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from checkpoints import _configs, model_class

# name: (architecture, dense dtype, llm_int8_skip_modules)
VARIANTS = {
    "llama-8bit-bf16": ("llama", torch.bfloat16, None),
    "qwen2-tied-8bit-fp16": ("qwen2", torch.float16, None),
    "mistral-skip-8bit-bf16": ("mistral", torch.bfloat16, ["down_proj", "lm_head"]),
    "phi3-fused-8bit-fp16": ("phi3", torch.float16, None),
    "gpt2-conv1d-8bit-bf16": ("gpt2", torch.bfloat16, None),
}


def build(folder: Path, variant: str, *, shard_size: str = "150KB", seed: int = 0) -> Path:
    """Save the 8-bit checkpoint of ``variant`` into ``folder``, sharded small, one weight's scales in a shard alone."""
    from transformers import BitsAndBytesConfig

    arch, dtype, skip = VARIANTS[variant]
    torch.manual_seed(seed)
    cls = model_class(arch)
    with tempfile.TemporaryDirectory() as dense:
        cls.from_config(_configs()[arch](), dtype=dtype).save_pretrained(dense)
        quantization = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
        model = cls.from_pretrained(dense, quantization_config=quantization, dtype=dtype, device_map="cpu")
        model.save_pretrained(folder, max_shard_size=shard_size)
    move_scales(folder)
    return folder


def move_scales(folder: Path) -> str:
    """Move one weight's SCB and weight_format into a shard of their own (as a real sharded save can); its name."""
    from safetensors.torch import load_file, save_file

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = index["weight_map"]
    prefix = next(k for k in sorted(weight_map) if k.endswith(".SCB"))[: -len("SCB")]
    moved = [prefix + "SCB", prefix + "weight_format"]
    scales = {}
    for file in sorted({weight_map[key] for key in moved}):
        tensors = load_file(folder / file)
        scales.update({k: tensors.pop(k) for k in moved if k in tensors})
        save_file(tensors, folder / file, metadata={"format": "pt"})
    save_file(scales, folder / "model-scales.safetensors", metadata={"format": "pt"})
    for key in moved:
        weight_map[key] = "model-scales.safetensors"
    index_path.write_text(json.dumps(index, indent=2))
    return prefix + "weight"
