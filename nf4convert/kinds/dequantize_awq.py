"""An AWQ weight (``formats/awq.py`` finds, checks and dequantizes it), in pieces of whole output rows: the same torch
arithmetic on the host and on a GPU.

GEMM packs eight output rows into each word of a packed row (``qweight`` [in, out / 8]): a piece of rows ``[first,
first + n)`` is the same ``n / 8`` words of every packed row, gathered from the codes read whole once per weight
(``pipeline/piece.py``: ``Columns``). GEMV packs along the input (``qweight`` [out, in / 8]): a piece's rows are one
range of the codes. Zeros and scales are read once per weight and sliced."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES
from ..formats import awq
from ..formats.packed_int import as_torch, host_array, rows_per_piece
from ..pipeline.piece import Columns, Piece
from .base import IntegerWeight, Planning, register

WORD = 4  # bytes of a packed int32 word


@register
@dataclass(frozen=True)
class DequantizeAwq(IntegerWeight):
    """An AWQ weight, dequantized as GPTQModel's ``dequantize_gemm`` does, in the scales' dtype, cast to the
    output's."""

    kind: ClassVar[str] = "dequantize_awq"
    label: ClassVar[str] = "dequantized from AWQ"
    format: ClassVar[type[awq.Awq]] = awq.Awq
    order: ClassVar[int] = 31
    weight: awq.AwqWeight

    @classmethod
    def plan_source(cls, planning: Planning) -> None:
        """An AWQ checkpoint's weights (each checked), by the packed codes' name."""
        if not planning.quantization or not cls.format.reads_config(planning.quantization):
            return
        model_type = (planning.config or {}).get("model_type")
        found = awq.find_weights(planning.tensors, planning.quantization, model_type, planning.reader)
        planning.claim({weight.qweight.name: cls(weight) for weight in found})

    @property
    def source_format(self) -> str:
        return f"{self.format.name} {self.weight.layout}"

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        weight = self.weight
        out_features, in_features = weight.shape
        if not tensor.nbytes:
            return
        gemm = weight.layout == "gemm"
        row_bytes = in_features * DTYPES[tensor.dtype].itemsize
        step = rows_per_piece(route.piece_bytes, row_bytes, awq.PIECE_ALIGN)
        starts = range(0, out_features, step)
        columns = Columns(weight.qweight, in_features, len(starts)) if gemm else None
        scales, qzeros = host_array(reader, weight.scales), host_array(reader, weight.qzeros)
        settings = dict(gemm=gemm, group_size=weight.group_size, scale=weight.scales.dtype, dtype=tensor.dtype)
        if route.gpu:
            scales = as_torch(scales, weight.scales.dtype).to(route.device)
            qzeros = as_torch(qzeros, weight.qzeros.dtype).to(route.device)
        for first in starts:
            count = min(step, out_features - first)
            if gemm:  # words of eight output rows along each packed row; zeros alike, scales a column each
                parts = dict(
                    scales=scales[:, first : first + count], qzeros=qzeros[:, first // 8 : (first + count) // 8]
                )
                read = dict(first=first // 8 * WORD, count=in_features * count // 8 * WORD)
                read["load"] = functools.partial(columns.load, first // 8 * WORD, count // 8 * WORD)
            else:  # a row each
                parts = dict(scales=scales[first : first + count], qzeros=qzeros[first : first + count])
                packed_row = weight.qweight.shape[1] * WORD
                read = dict(first=first * packed_row, count=count * packed_row)
            if route.gpu:
                make = route.make(None, functools.partial(dequantize_on_device, **parts, **settings))
            else:
                parts = {name: part.copy() for name, part in parts.items()}
                make = route.make(functools.partial(dequantize_on_host, **parts, **settings))
            yield Piece(first * row_bytes, count * row_bytes, weight.qweight, make=make, on_device=True, **read)


def _dequantize(codes, out, scales, qzeros, *, gemm: bool, group_size: int, dtype: str, **_) -> None:
    """A piece's rows into ``out`` (torch tensors on one device, ``codes`` its packed words and ``out`` its output,
    both as bytes)."""
    import torch

    words = codes.view(torch.int32)
    target = out.view(DTYPES[dtype].torch)
    if gemm:
        qweight = words.view(-1, qzeros.shape[1])
        target = target.view(scales.shape[1], qweight.shape[0])
        awq.dequantize_gemm(qweight, qzeros, scales, group_size=group_size, out=target)
    else:
        qweight = words.view(scales.shape[0], -1)
        target = target.view(scales.shape[0], qweight.shape[1] * awq.PACK)
        awq.dequantize_gemv(qweight, qzeros, scales, group_size=group_size, out=target)


def dequantize_on_host(codes, out, *, scales, qzeros, scale: str, **settings) -> None:
    """A piece's packed words (bytes, numpy uint8) dequantized into ``out`` (numpy uint8): its scales and zeros as
    numpy arrays of their bits."""
    import torch

    scales, qzeros = as_torch(scales, scale), torch.from_numpy(qzeros)
    _dequantize(torch.from_numpy(codes), torch.from_numpy(out), scales, qzeros, **settings)


def dequantize_on_device(codes, out, **settings):
    """A piece's packed words (a uint8 tensor on the GPU) dequantized into ``out`` (uint8, on the GPU) with its
    scales and zeros on that GPU. Returns ``out``."""
    _dequantize(codes, out, **settings)
    return out
