"""Source formats, one module each, registered where they are defined (``base.py``: what a format says of itself, the
registry, and what is asked of all formats at once). A format's module recognises its checkpoints, parses and checks
their weights, and brings its arithmetic.

- A registered format's module holds its class under ``@register`` (``bnb4_weights.py``, ``bnb8.py``, ``gptq.py``,
  ``awq.py``, ``fp8.py``, ``mxfp4.py``, the ``compressed_*.py`` of compressed-tensors, ...).
- The modules that register nothing are what formats share: ``bnb.py`` (bitsandbytes' family) and ``bnb4.py`` (its
  4-bit quant state), ``packed_int.py`` (integer codes packed into words), ``e8m0.py`` (power-of-two scales),
  ``nvfp4.py`` (NVFP4's weights and arithmetic).

Adapters are not source formats: they live in ``adapters/``; what config.json and transformers' model say lives in
``model/``.
"""
