"""Where a plan's tensors go: safetensors shards (``safetensors``), and the output folder's lifecycle."""
