"""Source formats, one module each, registered where they are defined (``base.py``: what a format says of itself, the
registry, and what is asked of all formats at once). A format's module recognises its checkpoints, parses and checks
their weights, and brings its arithmetic.

- ``bnb4.py`` (the 4-bit quant state), ``bnb4_weights.py`` (bitsandbytes 4-bit NF4/FP4 weights, registered),
  ``bnb8.py`` (bitsandbytes 8-bit LLM.int8 weights, registered), ``bnb.py`` (what both share).

Adapters are not source formats: they live in ``adapters/``; what config.json and transformers' model say lives in
``model/``.
"""
