"""llama.cpp's own quantizer, for verify to re-make a GGUF of llama-quantize's types: a ``llama-quantize`` binary
(named by ``$NF4CONVERT_LLAMA_QUANTIZE``, else found on PATH), or llama-cpp-python's ``llama_model_quantize`` (no
importance matrix: reading one is the command line's, not the library's). Never nf4convert's own quantizers."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

from ..errors import DependencyError

ENVIRONMENT = "NF4CONVERT_LLAMA_QUANTIZE"
HOW = (
    f"put llama.cpp's llama-quantize on PATH or name it in ${ENVIRONMENT} (cmake -B build && cmake --build build "
    "--target llama-quantize, in a clone of github.com/ggml-org/llama.cpp)"
)


class QuantizeFailed(Exception):
    """llama.cpp's quantizer refused or failed (its last line)."""


def find(gguf_type: str, imatrix: bool) -> Callable[[Path, Path, str | None], None]:
    """``quantize(IN, OUT, imatrix_path)`` making OUT of type ``gguf_type`` from IN as llama-quantize does.

    Raises:
        DependencyError: none is installed (llama-cpp-python does not count where ``imatrix``).
    """
    named = os.environ.get(ENVIRONMENT)
    binary = named or shutil.which("llama-quantize")
    if named and not (os.path.isfile(named) and os.access(named, os.X_OK)):
        raise DependencyError(f"${ENVIRONMENT} names {named}, which is not an executable file: {HOW}")
    if binary:
        return lambda source, out, matrix: _run(binary, source, out, gguf_type, matrix)
    if not imatrix:
        try:
            import llama_cpp
        except ImportError:
            llama_cpp = None
        if llama_cpp is not None:
            return lambda source, out, matrix: _library(llama_cpp, source, out, gguf_type)
    also = "" if imatrix else ", or pip install llama-cpp-python"
    raise DependencyError(f"verifying a {gguf_type} GGUF needs llama.cpp's own quantizer: {HOW}{also}")


def _run(binary: str, source: Path, out: Path, gguf_type: str, imatrix: str | None) -> None:
    command = [binary, *(["--imatrix", imatrix] if imatrix is not None else []), str(source), str(out)]
    done = subprocess.run([*command, gguf_type.upper()], capture_output=True, check=False)
    if done.returncode:
        lines = (done.stderr + done.stdout).decode(errors="replace").strip().splitlines()
        raise QuantizeFailed(f"{binary} failed ({done.returncode}): {lines[-1] if lines else 'no output'}")


def _library(llama_cpp, source: Path, out: Path, gguf_type: str) -> None:
    import ctypes

    from ..sinks.gguf.typeplan import FILE_TYPES

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FILE_TYPES[gguf_type.upper()][0]
    code = llama_cpp.llama_model_quantize(os.fsencode(source), os.fsencode(out), ctypes.byref(params))
    if code:
        raise QuantizeFailed(f"llama-cpp-python's llama_model_quantize failed ({code})")
