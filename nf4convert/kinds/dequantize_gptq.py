"""A GPTQ weight (``formats/gptq.py`` finds, checks and dequantizes it), in pieces of whole output rows: the same
torch arithmetic on the host and on a GPU.

An output row is a *column* of the packed codes (``qweight`` [packed rows, out]): a piece of rows ``[first, first +
n)`` is the same ``n`` columns of every packed row. The codes are read whole, once per weight, and each piece gathers
its columns from them (``pipeline/piece.py``: ``Columns``); its scales, zeros and group index are sliced from the
weight's, read once too (a sixty-fourth of the dense weight or less)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES
from ..formats import gptq
from ..formats.packed_int import as_torch, host_array, rows_per_piece
from ..pipeline.piece import Columns, Piece
from .base import IntegerWeight, Planning, register


@register
@dataclass(frozen=True)
class DequantizeGptq(IntegerWeight):
    """A GPTQ weight, dequantized as GPTQModel's torch kernel does, in the scales' dtype, cast to the output's."""

    kind: ClassVar[str] = "dequantize_gptq"
    label: ClassVar[str] = "dequantized from GPTQ"
    format: ClassVar[type[gptq.Gptq]] = gptq.Gptq
    order: ClassVar[int] = 30
    weight: gptq.GptqWeight

    @classmethod
    def plan_source(cls, planning: Planning) -> None:
        """A GPTQ checkpoint's weights (each checked), by the packed codes' name; the biases AutoGPTQ saved beside
        layers whose dense model has none are left out."""
        if not planning.quantization or not cls.format.reads_config(planning.quantization):
            return
        found = gptq.find_weights(planning.tensors, planning.reader, planning.quantization)
        planning.claim({weight.qweight.name: cls(weight) for weight in found})
        planning.consumed.update(gptq.unused_biases(found, planning.tensors, planning.config))

    @property
    def source_format(self) -> str:
        return f"{self.format.name} int{self.weight.bits}"

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        weight = self.weight
        out_features, in_features = weight.shape
        if not tensor.nbytes:
            return
        row_bytes = in_features * DTYPES[tensor.dtype].itemsize
        step = rows_per_piece(route.piece_bytes, row_bytes, gptq.PIECE_ALIGN)
        starts = range(0, out_features, step)
        packed_rows, word = weight.qweight.shape[0], DTYPES[weight.qweight.dtype].itemsize
        columns = Columns(weight.qweight, packed_rows, len(starts))
        scales, qzeros = host_array(reader, weight.scales), host_array(reader, weight.qzeros)
        # columns in order need no index; whole groups permuted (desc_act) are sorted into order; any other index
        # gathers each column's zero and scale
        g_idx = order = None
        if weight.grouped and not weight.in_order:
            order = gptq.group_order(host_array(reader, weight.g_idx))
        elif not weight.in_order:
            g_idx = host_array(reader, weight.g_idx)
        settings = dict(
            bits=weight.bits,
            v1=weight.v1,
            group_size=weight.group_size,
            in_features=in_features,
            word=weight.qweight.dtype,
            scale=weight.scales.dtype,
            dtype=tensor.dtype,
        )
        if route.gpu:
            scales, qzeros = as_torch(scales, weight.scales.dtype), as_torch(qzeros, weight.qzeros.dtype)
            scales, qzeros = scales.to(route.device), qzeros.to(route.device)
            g_idx = None if g_idx is None else as_torch(g_idx, weight.g_idx.dtype).to(route.device)
            order = None if order is None else as_torch(order, "I32").to(route.device)
        for first in starts:
            count = min(step, out_features - first)
            begin, end = weight.zero_words(first, count)
            parts = dict(scales=scales[:, first : first + count], qzeros=qzeros[:, begin:end], g_idx=g_idx, order=order)
            if route.gpu:
                make = route.make(None, functools.partial(dequantize_on_device, **parts, **settings))
            else:
                parts = {name: None if part is None else part.copy() for name, part in parts.items()}
                make = route.make(functools.partial(dequantize_on_host, **parts, **settings))
            yield Piece(
                first * row_bytes,
                count * row_bytes,
                weight.qweight,
                first * word,
                packed_rows * count * word,
                make,
                on_device=True,
                load=functools.partial(columns.load, first * word, count * word),
            )


def _dequantize(codes, out, scales, qzeros, g_idx, order, *, bits, v1, group_size, in_features, word, dtype, **_):
    """A piece's rows into ``out`` (torch tensors on one device, ``codes`` its packed columns and ``out`` its output,
    both as bytes)."""
    count = scales.shape[1]
    gptq.dequantize(
        codes.view(DTYPES[word].torch).view(-1, count),
        qzeros,
        scales,
        g_idx,
        bits=bits,
        v1=v1,
        group_size=group_size,
        in_features=in_features,
        out=out.view(DTYPES[dtype].torch).view(count, in_features),
        order=order,
    )


def dequantize_on_host(codes, out, *, scales, qzeros, g_idx, order, scale: str, **settings) -> None:
    """A piece's packed columns (bytes, numpy uint8) dequantized into ``out`` (numpy uint8): its scales, zeros, group
    index or order as numpy arrays of their bits."""
    import torch

    g_idx, order = (None if array is None else torch.from_numpy(array) for array in (g_idx, order))
    scales, qzeros = as_torch(scales, scale), torch.from_numpy(qzeros)
    _dequantize(torch.from_numpy(codes), torch.from_numpy(out), scales, qzeros, g_idx, order, **settings)


def dequantize_on_device(codes, out, **settings):
    """A piece's packed columns (a uint8 tensor on the GPU) dequantized into ``out`` (uint8, on the GPU) with its
    scales, zeros and group index on that GPU. Returns ``out``."""
    _dequantize(codes, out, **settings)
    return out
