"""A plain tensor: its bytes as they are, or cast to the output dtype where it is floating (every floating tensor
takes the output dtype, so the checkpoint is of one dtype). Every source tensor no other kind reads is one. Casts run
on the CPU on every route (``kernels/cpu.py``), so that every route writes the same bits."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES, OUTPUT_DTYPES, DType
from ..errors import CheckpointError
from ..formats.base import all_formats
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
        """Every source tensor that no recipe reads, each checked: CheckpointError for one that would be copied raw
        where a dense model has no place for it (``_refuse_raw``)."""
        made = {}
        for anchor, recipe in planning.recipes.items():
            made.setdefault(recipe.output(OUTPUT_DTYPES["float32"])[0], anchor)
        for name, info in planning.tensors.items():
            if name not in planning.consumed and name not in planning.recipes:
                _refuse_raw(planning, info, made.get(name))
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


def _refuse_raw(planning: Planning, info: TensorInfo, made_by: str | None) -> None:
    """CheckpointError for a tensor that a plain copy would write wrong into a dense model: one of the name a
    quantized weight already makes (``made_by``: that weight's anchor; a layer stored dense and quantized), one that
    only a quantized checkpoint holds that no weight read (a scale whose codes are missing, a format's tensors inside
    a checkpoint of another), or, in a quantized checkpoint, integer or FP8 codes named as a layer's weight (its
    scales missing, or stored as no format reads): a dense model would load the codes as its values."""
    at = f"{info.path}: tensor '{info.name}'"
    if made_by is not None:
        raise CheckpointError(
            f"{at} and tensor '{made_by}' (a quantized weight) both make '{info.name}'; a layer is stored dense or "
            "quantized, not both"
        )
    owners = list(dict.fromkeys(f.family for f in all_formats().values() if f.is_quantization_key(info.name)))
    if owners:
        raise CheckpointError(
            f"{at} is {' or '.join(owners)} quantization data that no quantized weight of the checkpoint reads (its "
            "weight missing, or stored as this does not read); copied, a dense model would hold it raw"
        )
    codes = DTYPES[info.dtype].name.startswith(("int", "uint", "float8"))
    if planning.quantization and codes and info.name.endswith(".weight") and len(info.shape) >= 2:
        raise CheckpointError(
            f"{at} is {info.dtype}: quantized codes named as a layer's weight, with no scales this reads beside it; "
            "copied, a dense model would load the codes as its values"
        )
