"""What is known of the model itself rather than of its quantization: config.json (``config.py``: quantization,
tying, the vocabulary, the dense config), which architectures store weights transposed (``conv1d.py``), and
transformers' own model built on the meta device (``skeleton.py``)."""
