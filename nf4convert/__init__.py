"""nf4convert: turn quantized checkpoints (bitsandbytes, GPTQ, AWQ, FP8, MXFP4, compressed-tensors, ModelOpt) back
into dense safetensors or GGUF, bit for bit as their reference libraries dequantize them.

Public API (imported lazily: the CLI starts without torch, and importing the package runs next to nothing before the
console script's first statements, ``entry.py``):

    dequantize_4bit(packed, quant_state, *, out=None, backend="auto") -> torch.Tensor
    convert(source, output=None, *, dtype="auto", device="auto", ...) -> ConvertResult
    verify(output, source, *, device="auto", ...) -> VerifyReport
    push_to_hub(folder, repo_id, *, private=False, token=None, revision=None, progress=True) -> str
    QuantState4bit, ConvertResult, VerifyReport
    Nf4ConvertError and its subclasses ArgumentError, SourceNotFoundError (FetchError), CheckpointError
    (IntegrityError), OutputError, UploadError, DependencyError, WorkerError, InternalError
"""

__version__ = "0.1.0"

_EXPORTS = {
    "dequantize_4bit": ("nf4convert.dequantize", "dequantize_4bit"),
    "QuantState4bit": ("nf4convert.formats.bnb4", "QuantState4bit"),
    "convert": ("nf4convert.conversion", "convert"),
    "ConvertResult": ("nf4convert.conversion", "ConvertResult"),
    "verify": ("nf4convert.verification.verify", "verify"),
    "VerifyReport": ("nf4convert.verification.report", "VerifyReport"),
    "push_to_hub": ("nf4convert.hub.upload", "push_to_hub"),
    "Nf4ConvertError": ("nf4convert.errors", "Nf4ConvertError"),
    "ArgumentError": ("nf4convert.errors", "ArgumentError"),
    "SourceNotFoundError": ("nf4convert.errors", "SourceNotFoundError"),
    "CheckpointError": ("nf4convert.errors", "CheckpointError"),
    "OutputError": ("nf4convert.errors", "OutputError"),
    "UploadError": ("nf4convert.errors", "UploadError"),
    "DependencyError": ("nf4convert.errors", "DependencyError"),
    "FetchError": ("nf4convert.errors", "FetchError"),
    "IntegrityError": ("nf4convert.errors", "IntegrityError"),
    "WorkerError": ("nf4convert.errors", "WorkerError"),
    "InternalError": ("nf4convert.errors", "InternalError"),
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
