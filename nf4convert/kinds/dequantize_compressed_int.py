"""A compressed-tensors integer weight (``formats/compressed_int.py`` finds, checks and dequantizes it), in pieces of
whole rows, each one range of the codes (packed along the rows, or int8 a row each): the same torch arithmetic on
the host and on a GPU. Scales and zero points are read once per weight and sliced (zero points packed along the
output dimension: a piece starts on whole words of them)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES
from ..formats import compressed_int
from ..formats.packed_int import as_torch, host_array, rows_per_piece
from ..pipeline.piece import Piece
from .base import IntegerWeight, Planning, register


@register
@dataclass(frozen=True)
class DequantizeCompressedInt(IntegerWeight):
    """A compressed-tensors integer weight, decompressed as compressed-tensors does, in the scales' dtype, cast to
    the output's."""

    kind: ClassVar[str] = "dequantize_compressed_int"
    label: ClassVar[str] = "dequantized from compressed-tensors integers"
    format: ClassVar[type[compressed_int.CompressedInt]] = compressed_int.CompressedInt
    order: ClassVar[int] = 32
    weight: compressed_int.CompressedIntWeight

    @classmethod
    def plan_source(cls, planning: Planning) -> None:
        """The layers of the checkpoint's integer config groups (each checked), by their codes' name; their
        activations' and the KV cache's scales are left out (a dense model has no place for them)."""
        quantization = planning.quantization
        if not quantization or not cls.format.reads_config(quantization):
            return
        found = compressed_int.find_weights(planning.tensors, planning.reader, quantization)
        planning.claim({weight.codes.name: cls(weight) for weight in found})
        planning.consumed.update(compressed_int.activation_keys(found, planning.tensors, quantization))

    @property
    def source_format(self) -> str:
        return f"{self.format.name} int{self.weight.scheme.bits}"

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        weight = self.weight
        out_features, in_features = weight.shape
        if not tensor.nbytes:
            return
        packed = weight.scheme.format == compressed_int.PACKED
        row_bytes = in_features * DTYPES[tensor.dtype].itemsize
        step = rows_per_piece(route.piece_bytes, row_bytes, compressed_int.PIECE_ALIGN)
        source_row = weight.codes.nbytes // out_features
        scale = host_array(reader, weight.scale)
        zero_point = None if weight.zero_point is None else host_array(reader, weight.zero_point)
        settings = dict(
            bits=weight.scheme.bits if packed else None,
            in_features=in_features,
            scale_code=weight.scale.dtype,
            dtype=tensor.dtype,
        )
        if route.gpu:
            scale = as_torch(scale, weight.scale.dtype).to(route.device)
            zero_point = None if zero_point is None else as_torch(zero_point, weight.zero_point.dtype).to(route.device)
        for first in range(0, out_features, step):
            count = min(step, out_features - first)
            zeros = None
            if zero_point is not None:
                begin, end = weight.zero_rows(first, count) if packed else (first, first + count)
                zeros = zero_point[begin:end]
            parts = dict(scale=scale[first : first + count], zero_point=zeros)
            if route.gpu:
                make = route.make(None, functools.partial(dequantize_on_device, **parts, **settings))
            else:
                parts = {name: None if part is None else part.copy() for name, part in parts.items()}
                make = route.make(functools.partial(dequantize_on_host, **parts, **settings))
            yield Piece(
                first * row_bytes,
                count * row_bytes,
                weight.codes,
                first * source_row,
                count * source_row,
                make,
                on_device=True,
            )


def _dequantize(codes, out, scale, zero_point, *, bits, in_features: int, dtype: str, **_) -> None:
    """A piece's rows into ``out`` (torch tensors on one device, ``codes`` its rows of codes and ``out`` its output,
    both as bytes)."""
    import torch

    rows = scale.shape[0]
    target = out.view(DTYPES[dtype].torch).view(rows, in_features)
    if bits is None:  # naive: int8 codes, a row each
        codes = codes.view(torch.int8).view(rows, in_features)
        compressed_int.dequantize_naive(codes, scale, zero_point, out=target)
    else:
        packed = codes.view(torch.int32).view(rows, -1)
        compressed_int.dequantize_packed(packed, scale, zero_point, bits=bits, in_features=in_features, out=target)


def dequantize_on_host(codes, out, *, scale, zero_point, scale_code: str, **settings) -> None:
    """A piece's rows of codes (bytes, numpy uint8) dequantized into ``out`` (numpy uint8): its scales and zero points
    as numpy arrays of their bits."""
    import torch

    zero_point = None if zero_point is None else torch.from_numpy(zero_point)
    _dequantize(torch.from_numpy(codes), torch.from_numpy(out), as_torch(scale, scale_code), zero_point, **settings)


def dequantize_on_device(codes, out, **settings):
    """A piece's rows of codes (a uint8 tensor on the GPU) dequantized into ``out`` (uint8, on the GPU) with its scales
    and zero points on that GPU. Returns ``out``."""
    _dequantize(codes, out, **settings)
    return out
