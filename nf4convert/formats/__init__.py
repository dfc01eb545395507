"""One module per source format; each says what its tensors are, checks them, and how to rebuild the dense tensor.

- ``bnb4``: bitsandbytes 4-bit (NF4/FP4) weights and their quant states.
- ``bnb8``: bitsandbytes 8-bit (LLM.int8) weights: int8 codes and per-row scales (SCB).
- ``peft_lora``: peft LoRA adapters: which base tensors they change, and the merge, bit for bit with peft.
"""
