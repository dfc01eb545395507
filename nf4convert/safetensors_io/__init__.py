"""safetensors at the byte level: ``read`` (strict headers, the index, positional reads) apart from ``write``."""
