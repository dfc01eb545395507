"""A plain tensor: its bytes as they are, or cast to the output dtype where it is floating (every floating tensor
takes the output dtype, so the checkpoint is of one dtype). Casts run on the CPU on every route."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES, DType
from ..pipeline.piece import Piece
from ..safetensors_io.read import TensorInfo
from .base import Recipe


@dataclass(frozen=True)
class Copy(Recipe):
    """The source tensor's bytes, cast to the output tensor's dtype where they differ."""

    kind: ClassVar[str] = "copy"
    label: ClassVar[str] = "copied"
    plain: ClassVar[bool] = True
    numpy_made: ClassVar[bool] = True
    source: TensorInfo

    @property
    def sources(self) -> tuple:
        return (self.source,)

    def output(self, dtype: DType) -> tuple[str, str, tuple]:
        source = self.source
        return source.name, dtype.code if DTYPES[source.dtype].cast else source.dtype, source.shape

    def exceeds_fp16(self) -> bool:
        return self.source.dtype in ("BF16", "F32", "F64")

    def converts_to(self, code: str) -> bool:
        return self.source.dtype != code

    @property
    def plain_dtype(self) -> str | None:
        return DTYPES[self.source.dtype].name if DTYPES[self.source.dtype].cast else None

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        source = self.source
        source_type, target_type = DTYPES[source.dtype], DTYPES[tensor.dtype]
        cast = route.cast(source.dtype, tensor.dtype) if source.dtype != tensor.dtype else None
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
