"""A GGUF quant type as llama.cpp writes it: ``QuantType`` (its name, ggml type id, block geometry and
``quantize``), each type a subclass in its own module of this package, registered there (``QUANTS``)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from nf4convert.registry import Registry

from .arith import row_mean_squares

QUANTS = Registry(__package__, "GGUF quant type", "name")


def quant_type(name: str | int) -> type["QuantType"]:
    """The registered type of llama.cpp's name ``name`` ("Q4_K", case-insensitive) or of ggml type id ``name``."""
    types = QUANTS.discovered()
    if isinstance(name, int):
        found = next((kind for kind in types.values() if kind.type_id == name), None)
    else:
        found = types.get(name.upper())
    if found is None:
        raise KeyError(f"no GGUF quant type {name!r}; known: {', '.join(sorted(types))}")
    return found


class QuantType:
    """One of ggml's types, quantized as ``ggml_quantize_chunk`` does on x86-64: ``quantize(rows, imatrix)``.

    A subclass declares ``name`` (llama.cpp's, as ``ggml_type_name`` upper-cased), ``type_id`` (``enum ggml_type``),
    ``block_size`` (values per block) and ``type_size`` (bytes per block), and implements ``quantize_blocks``. The
    base cuts the rows into chunks of ``chunk_blocks`` blocks, so that every intermediate array stays cache-sized
    while each numpy call still covers many blocks."""

    name: ClassVar[str]
    type_id: ClassVar[int]
    block_size: ClassVar[int]
    type_size: ClassVar[int]
    chunk_blocks: ClassVar[int] = 1024
    # whether an importance matrix changes anything (Q8_0 and F16 ignore it, as ggml does)
    uses_imatrix: ClassVar[bool] = True
    # whether the importance-matrix path needs each row's mean square (the legacy types' sigma2)
    uses_row_mean_square: ClassVar[bool] = False

    @classmethod
    def row_size(cls, n_per_row: int) -> int:
        """``ggml_row_size``: the bytes of one row of ``n_per_row`` values."""
        return n_per_row // cls.block_size * cls.type_size

    @classmethod
    def quantize(cls, rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
        """``ggml_quantize_chunk(type, rows, dst, 0, n_rows, n_per_row, imatrix)``'s bytes as uint8
        ``(n_rows, row_size(n_per_row))``. ``rows``: float32 ``(n_rows, n_per_row)``, ``n_per_row`` a multiple of
        ``block_size``; ``imatrix``: float32 ``(n_per_row,)`` importance weights, or None."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[1] % cls.block_size:
            raise ValueError(f"{cls.name} quantizes rows of a multiple of {cls.block_size} values, not {rows.shape}")
        n_rows, n_per_row = rows.shape
        per_row = n_per_row // cls.block_size
        weights = None
        if imatrix is not None:
            imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
            if imatrix.shape != (n_per_row,):
                raise ValueError(f"an importance matrix of {imatrix.shape} for rows of {n_per_row} values")
            if cls.uses_imatrix:
                weights = imatrix.reshape(per_row, cls.block_size)
        blocks = rows.reshape(-1, cls.block_size)
        out = np.empty((blocks.shape[0], cls.type_size), dtype=np.uint8)
        with np.errstate(all="ignore"):
            mean_square = None
            if weights is not None and cls.uses_row_mean_square:
                mean_square = np.concatenate([row_mean_squares(rows[r : r + 256]) for r in range(0, n_rows, 256)])
            for start in range(0, blocks.shape[0], cls.chunk_blocks):
                stop = min(start + cls.chunk_blocks, blocks.shape[0])
                index = np.arange(start, stop)
                block_weights = None if weights is None else weights[index % per_row]
                block_mean_square = None if mean_square is None else mean_square[index // per_row]
                out[start:stop] = cls.quantize_blocks(blocks[start:stop], block_weights, block_mean_square)
        return out.reshape(n_rows, per_row * cls.type_size)

    @classmethod
    def quantize_blocks(cls, blocks, weights, mean_square) -> np.ndarray:
        """Blocks (B, block_size) float32 -> (B, type_size) uint8. ``weights``: the importance weights of each
        block's positions (B, block_size), or None; ``mean_square``: its row's mean square (B,) where
        ``uses_row_mean_square`` and an importance matrix is given, else None."""
        raise NotImplementedError
