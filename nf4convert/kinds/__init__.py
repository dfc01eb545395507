"""Tensor kinds, one module each, registered where they are defined (``base.py``: what every kind answers, the
registry, what a kind plans from). A kind plans itself from the checkpoint's headers and brings its compute; the
reference each is checked against lives in ``verification/reference/`` under the same module name.

- ``dequantize_*.py``: a source format's weights, claimed and dequantized (bitsandbytes' ``4bit`` and ``8bit``,
  ``gptq``, ``awq``, ``fp8``, ``mxfp4``, ``nvfp4``, the ``compressed_*`` of compressed-tensors).
- ``transpose.py``: a claimed Conv1D weight, written (in, out).
- ``copy.py``: every other source tensor, cast to the output dtype where it is floating.
- ``merge_lora.py`` (with ``untied.py``, a tied base's head written apart): an adapter's change merged in.
"""
