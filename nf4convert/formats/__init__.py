"""Source formats, one module each, registered where they are defined (``base.py``: what a format says of itself, the
registry, and what is asked of all formats at once). A format's module recognises its checkpoints, parses and checks
their weights, and brings its arithmetic.

- ``bnb4.py`` (the 4-bit quant state), ``bnb4_weights.py`` (bitsandbytes 4-bit NF4/FP4 weights, registered),
  ``bnb8.py`` (bitsandbytes 8-bit LLM.int8 weights, registered), ``bnb.py`` (what both share).
- ``conv1d.py``: which layers transformers quantized transposed (GPT-2's Conv1D).
- ``peft_*.py``: peft LoRA adapters: which base tensors they change, and the merge, bit for bit with peft.
- ``config.py``: config.json: what it says of quantization, tying and the vocabulary; the dense model's config.
"""
