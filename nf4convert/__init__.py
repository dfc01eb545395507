"""nf4convert: turn bitsandbytes 4-bit (NF4/FP4) checkpoints back into dense safetensors checkpoints.

Public API (imported lazily, so the CLI starts without torch):

    dequantize_4bit(packed, quant_state, *, out=None, backend="auto")
    convert(source, output, ...)
    verify(output, source, ...)
"""

__version__ = "0.1.0"

_EXPORTS = {
    "dequantize_4bit": ("nf4convert.dequantize", "dequantize_4bit"),
    "QuantState4bit": ("nf4convert.quant_state", "QuantState4bit"),
    "convert": ("nf4convert.convert", "convert"),
    "verify": ("nf4convert.verify", "verify"),
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        module, attribute = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value  # later lookups skip this hook (it costs microseconds per call)
        return value
    raise AttributeError(f"module 'nf4convert' has no attribute {name!r}")
