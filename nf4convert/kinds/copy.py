"""A plain tensor: its bytes as they are, or cast to the output dtype where it is floating (every floating tensor
takes the output dtype, so the checkpoint is of one dtype). Every source tensor no other kind reads is one. Casts run
on the CPU on every route (``kernels/cpu.py``), so that every route writes the same bits."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES, DType
from ..pipeline.piece import Piece
from ..safetensors_io.read import TensorInfo
from .base import Planning, Recipe, register


@register
@dataclass(frozen=True)
class Copy(Recipe):
    """The source tensor's bytes, cast to the output tensor's dtype where they differ."""

    kind: ClassVar[str] = "copy"
    label: ClassVar[str] = "copied"
    order: ClassVar[int] = 100  # after every kind that claims or wraps source tensors
    plain: ClassVar[bool] = True
    numpy_made: ClassVar[bool] = True
    source: TensorInfo
    keep: bool = False  # the source's dtype kept whatever the output's (a kind that plans it so says why)

    @classmethod
    def plan_source(cls, planning: Planning) -> None:
        """Every source tensor that no recipe reads."""
        for name, info in planning.tensors.items():
            if name not in planning.consumed and name not in planning.recipes:
                planning.recipes[name] = cls(info)

    @property
    def sources(self) -> tuple:
        return (self.source,)

    def output(self, dtype: DType) -> tuple[str, str, tuple]:
        source = self.source
        return source.name, dtype.code if DTYPES[source.dtype].cast and not self.keep else source.dtype, source.shape

    def exceeds_fp16(self) -> bool:
        return self.source.dtype in ("BF16", "F32", "F64") and not self.keep

    def converts_to(self, code: str) -> bool:
        return self.source.dtype != code

    @property
    def plain_dtype(self) -> str | None:
        return DTYPES[self.source.dtype].name if DTYPES[self.source.dtype].cast else None

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        source = self.source
        source_type, target_type = DTYPES[source.dtype], DTYPES[tensor.dtype]
        cast = None
        if source.dtype != tensor.dtype:
            cast = route.make(functools.partial(cast_on_host, source_dtype=source.dtype, target_dtype=tensor.dtype))
        step = max(1, route.piece_bytes // max(source_type.itemsize, target_type.itemsize))  # elements
        n_elements = source.nbytes // source_type.itemsize
        for first in range(0, n_elements, step):
            count = min(step, n_elements - first)
            yield Piece(
                first * target_type.itemsize,
                count * target_type.itemsize,
                source,
                first * source_type.itemsize,
                count * source_type.itemsize,
                cast,
            )


def cast_on_host(read, out, *, source_dtype: str, target_dtype: str) -> None:
    """A piece's elements (bytes ``read``, numpy uint8) cast from ``source_dtype`` into ``out`` as ``target_dtype``
    (safetensors' names)."""
    from ..kernels import cpu

    cpu.cast(read, source_dtype, out, target_dtype)
