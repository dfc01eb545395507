"""The GGUF sink's own options, declared here (a light module: ``--help`` imports it, not the sink): checked by the sink
(``sink.py``: ``check_options``), used in ``requant.py`` and ``filewrite.py``."""

from __future__ import annotations

import os

from ...options import declare
from .converter import ALL_TYPES


def _lowered(gguf_type):
    return gguf_type.lower() if isinstance(gguf_type, str) else gguf_type


declare(
    "gguf_type",
    "Write one GGUF file of this type, as llama.cpp's converter writes it from the dense output (default with a .gguf "
    "OUT: the --dtype's own float type); q4_k_m and llama-quantize's other types: the file llama-quantize makes of "
    "that one, byte for byte.",
    parse=_lowered,
    choices=ALL_TYPES,
    after="dtype",
)
declare(
    "imatrix",
    "Importance matrix for a llama-quantize type (GGUF or legacy .dat), as llama-quantize takes it.",
    parse=os.fspath,
    file=True,
    after="dtype",
)  # as the user named it
