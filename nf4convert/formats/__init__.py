"""One module per source format; each says what its tensors are, checks them, and how to rebuild the dense tensor.

- ``bnb4``: bitsandbytes 4-bit (NF4/FP4) weights and their quant states.
- ``bnb8``: bitsandbytes 8-bit (LLM.int8) weights: int8 codes and per-row scales (SCB).
- ``conv1d``: which layers transformers quantized transposed (GPT-2's Conv1D).
- ``peft_lora``: peft LoRA adapters: which base tensors they change, and the merge, bit for bit with peft.
- ``config``: config.json: what it says of quantization, tying and the vocabulary; the dense model's config.
"""

import re

from . import bnb4_weights, bnb8

# Every source tensor whose bytes a plan reads, by name (each format's own list; the rest it knows from headers): a Hub
# dry run fetches just these (hub.py). A reader given a headers-only copy refuses any other bytes, so a format that
# reads more without saying so here fails that dry run in one line, never plans from zeros.
PLAN_READS = re.compile("|".join(f"(?:{reads.pattern})" for reads in (bnb4_weights.PLAN_READS, bnb8.PLAN_READS)))
