"""One module per source format; each says what its tensors are, checks them, and how to rebuild the dense tensor.

- ``bnb4``: bitsandbytes 4-bit (NF4/FP4) weights and their quant states.
"""
