"""nf4convert: turn bitsandbytes 4-bit (NF4/FP4) and 8-bit (LLM.int8) checkpoints back into dense safetensors.

Public API (imported lazily, so the CLI starts without torch):

    dequantize_4bit(packed, quant_state, *, out=None, backend="auto") -> torch.Tensor
    convert(source, output=None, *, dtype="auto", device="auto", ...) -> ConvertResult
    verify(output, source, *, device="auto", ...) -> VerifyReport
    push_to_hub(folder, repo_id, *, private=False, token=None, revision=None, progress=True) -> str
    QuantState4bit, ConvertResult, VerifyReport
    Nf4ConvertError and its subclasses ArgumentError, SourceNotFoundError, CheckpointError, OutputError, UploadError,
    DependencyError
"""

from .errors import (
    ArgumentError,
    CheckpointError,
    DependencyError,
    Nf4ConvertError,
    OutputError,
    SourceNotFoundError,
    UploadError,
)

__version__ = "0.1.0"

_EXPORTS = {
    "dequantize_4bit": ("nf4convert.dequantize", "dequantize_4bit"),
    "QuantState4bit": ("nf4convert.formats.bnb4", "QuantState4bit"),
    "convert": ("nf4convert.conversion", "convert"),
    "ConvertResult": ("nf4convert.conversion", "ConvertResult"),
    "verify": ("nf4convert.verification", "verify"),
    "VerifyReport": ("nf4convert.verification", "VerifyReport"),
    "push_to_hub": ("nf4convert.upload", "push_to_hub"),
}

__all__ = [
    "__version__",
    *_EXPORTS,
    "Nf4ConvertError",
    "ArgumentError",
    "SourceNotFoundError",
    "CheckpointError",
    "OutputError",
    "UploadError",
    "DependencyError",
]


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        module, attribute = _EXPORTS[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value  # later lookups skip this hook (it costs microseconds per call)
        return value
    raise AttributeError(f"module 'nf4convert' has no attribute {name!r}")
