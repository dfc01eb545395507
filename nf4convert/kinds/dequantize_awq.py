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

from ..dtypes import DTYPES, DType
from ..formats import awq
from ..formats.packed_int import as_torch, host_array, rows_per_piece
from ..pipeline.piece import Columns, Piece
from .base import Planning, Recipe, register

WORD = 4  # bytes of a packed int32 word


@register
@dataclass(frozen=True)
class DequantizeAwq(Recipe):
    """An AWQ weight, dequantized as GPTQModel's ``dequantize_gemm`` does, in the scales' dtype, cast to the
    output's."""

    kind: ClassVar[str] = "dequantize_awq"
    label: ClassVar[str] = "dequantized from AWQ"
    format: ClassVar[type[awq.Awq]] = awq.Awq
    order: ClassVar[int] = 31
    is_quantized: ClassVar[bool] = True
    weight: awq.AwqWeight

    @classmethod
    def plan_source(cls, planning: Planning) -> None:
        """An AWQ checkpoint's weights (each checked), by the packed codes' name."""
        if not planning.quantization or not cls.format.reads_config(planning.quantization):
            return
        model_type = (planning.config or {}).get("model_type")
        found = awq.find_weights(planning.tensors, planning.quantization, model_type)
        planning.claim({weight.qweight.name: cls(weight) for weight in found})

    @property
    def sources(self) -> tuple:
        return self.weight.sources

    def output(self, dtype: DType) -> tuple[str, str, tuple]:
        return self.weight.name, dtype.code, self.weight.shape

    def exceeds_fp16(self) -> bool:
        return self.weight.dtype != "F16"

    @property
    def quantized_from(self) -> str | None:
        return DTYPES[self.weight.dtype].name

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
                parts = dict(scales=scales[:, first : first + count], qzeros=qzeros[:, first // 8 : (first + count) // 8])
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


def _dequantize(codes, scales, qzeros, *, gemm: bool, group_size: int, scale: str, dtype: str):
    """A piece's rows (torch tensors on one device: ``codes`` its packed words as uint8), in ``dtype``."""
    import torch

    out_dtype = DTYPES[dtype].torch
    if gemm:
        qweight = codes.view(torch.int32).view(-1, qzeros.shape[1])
        return awq.dequantize_gemm(qweight, qzeros, scales, group_size=group_size, out_dtype=out_dtype)
    qweight = codes.view(torch.int32).view(scales.shape[0], -1)
    return awq.dequantize_gemv(qweight, qzeros, scales, group_size=group_size, out_dtype=out_dtype)


def dequantize_on_host(codes, out, *, scales, qzeros, scale: str, dtype: str, **settings) -> None:
    """A piece's packed words (bytes, numpy uint8) dequantized into ``out`` (numpy uint8): its scales and zeros as
    numpy arrays of their bits."""
    import torch

    dense = _dequantize(
        torch.from_numpy(codes), as_torch(scales, scale), torch.from_numpy(qzeros), scale=scale, dtype=dtype, **settings
    )
    torch.from_numpy(out).view(DTYPES[dtype].torch).view(dense.shape).copy_(dense)


def dequantize_on_device(codes, out, *, dtype: str, **settings):
    """A piece's packed words (a uint8 tensor on the GPU) dequantized with its scales and zeros on that GPU. Returns
    the bytes made, a uint8 tensor on the GPU."""
    dense = _dequantize(codes, dtype=dtype, **settings)
    out.view(DTYPES[dtype].torch).view(dense.shape).copy_(dense)
    return out
