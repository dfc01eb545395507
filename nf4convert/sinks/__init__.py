"""Where a plan's tensors go: safetensors shards (``safetensors``) or one GGUF file (``gguf`` and its helpers); the
output's lifecycle (``output``), its default name (``naming``) and the files beside the weights (``side_files``)."""
