"""A GGUF quant type as llama.cpp writes it: ``QuantType`` (its name, ggml type id, block geometry and
``quantize``), each type a subclass in its own module of this package, registered there (``QUANTS``)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from nf4convert.registry import Registry

from .arith import row_mean_squares
from .xp import NUMPY, is_torch, namespace

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
    while each numpy call still covers many blocks (of ``device_chunk_values`` values for torch tensors).
    ``quantize_blocks`` is written once for numpy and torch alike: its operations come from ``xp.namespace`` of its
    input."""

    name: ClassVar[str]
    type_id: ClassVar[int]
    block_size: ClassVar[int]
    type_size: ClassVar[int]
    chunk_blocks: ClassVar[int] = 1024
    # values per chunk where the rows are torch tensors: each operation then covers enough blocks to fill a GPU
    device_chunk_values: ClassVar[int] = 1 << 24
    # whether an importance matrix changes anything (Q8_0 and F16 ignore it, as ggml does)
    uses_imatrix: ClassVar[bool] = True
    # whether the importance-matrix path needs each row's mean square (the legacy types' sigma2)
    uses_row_mean_square: ClassVar[bool] = False

    @classmethod
    def row_size(cls, n_per_row: int) -> int:
        """``ggml_row_size``: the bytes of one row of ``n_per_row`` values."""
        return n_per_row // cls.block_size * cls.type_size

    @classmethod
    def quantize(cls, rows, imatrix=None):
        """``ggml_quantize_chunk(type, rows, dst, 0, n_rows, n_per_row, imatrix)``'s bytes as uint8
        ``(n_rows, row_size(n_per_row))``. ``rows``: ``(n_rows, n_per_row)``, ``n_per_row`` a multiple of
        ``block_size``: a float32 numpy array (the bytes are a numpy array), or a torch tensor of any float dtype on
        any device, a CUDA GPU's included (the bytes are a uint8 tensor on that device, the same bytes: the
        arithmetic is the same code, one IEEE float32 operation at a time); ``imatrix``: float32 ``(n_per_row,)``
        importance weights (numpy or torch), or None."""
        if is_torch(rows):
            import torch

            rows = rows.detach().to(torch.float32).contiguous()
            chunk_blocks = max(1, cls.device_chunk_values // cls.block_size)
        else:
            rows = np.ascontiguousarray(rows, dtype=np.float32)
            chunk_blocks = cls.chunk_blocks
        xp = namespace(rows)
        if rows.ndim != 2 or rows.shape[1] % cls.block_size:
            raise ValueError(
                f"{cls.name} quantizes rows of a multiple of {cls.block_size} values, not {tuple(rows.shape)}"
            )
        n_rows, n_per_row = rows.shape
        per_row = n_per_row // cls.block_size
        weights = None
        if imatrix is not None:
            imatrix = _like(imatrix, rows)
            if tuple(imatrix.shape) != (n_per_row,):
                raise ValueError(f"an importance matrix of {tuple(imatrix.shape)} for rows of {n_per_row} values")
            if cls.uses_imatrix:
                weights = imatrix.reshape(per_row, cls.block_size)
        blocks = rows.reshape(-1, cls.block_size)
        out = xp.empty((blocks.shape[0], cls.type_size), np.uint8, rows)
        with xp.errstate():
            mean_square = None
            if weights is not None and cls.uses_row_mean_square:
                step = 256 if xp is NUMPY else max(n_rows, 1)  # cache-sized on the CPU, one pass on a device
                mean_square = xp.concatenate([row_mean_squares(rows[r : r + step]) for r in range(0, n_rows, step)])
            for start in range(0, blocks.shape[0], chunk_blocks):
                stop = min(start + chunk_blocks, blocks.shape[0])
                index = xp.arange(start, stop, rows)
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


def _like(imatrix, rows):
    """``imatrix`` (numpy or torch) as float32 where ``rows`` are."""
    if is_torch(rows):
        import torch

        return torch.as_tensor(imatrix, dtype=torch.float32, device=rows.device).contiguous()
    if is_torch(imatrix):
        imatrix = imatrix.detach().cpu().float().numpy()
    return np.ascontiguousarray(imatrix, dtype=np.float32)
