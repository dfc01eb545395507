"""An FP8 weight of an ``fp8`` checkpoint (``formats/fp8.py``; compressed-tensors FP8 is its subclass, the kind
``dequantize_compressed_fp8``): each e4m3 code times its block's scale in fp32, rounded once to the output dtype,
in pieces of whole rows of scale blocks (no two pieces share a scale row): the same torch ops on the host and on a
GPU, so both routes write the same bytes. The activation scales such checkpoints carry (static FP8) are dropped: a
dense model has no place for them; their fp32 tensors are copied as fp32."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar, Iterator

from ..dtypes import DTYPES
from ..errors import CheckpointError
from ..formats import compressed_float, fp8, modelopt_fp8
from ..pipeline.piece import Piece
from .base import Planning, QuantizedWeight, register
from .copy import Copy

# the formats whose weights are FP8 codes
FP8_FORMATS = (fp8.Fp8Format, compressed_float.CompressedFloatFormat, modelopt_fp8.ModeloptFp8Format)


@register
@dataclass(frozen=True)
class DequantizeFp8(QuantizedWeight):
    """An FP8 weight times its scales, in the output dtype."""

    kind: ClassVar[str] = "dequantize_fp8"
    label: ClassVar[str] = "dequantized from FP8"
    format: ClassVar[type[fp8.Fp8Format]] = fp8.Fp8Format
    order: ClassVar[int] = 30
    activation_names: ClassVar[tuple[str, ...]] = fp8.ACTIVATION_NAMES  # tensors a dense model has no place for
    weight: fp8.WeightFp8

    @classmethod
    def plan_source(cls, planning: Planning) -> None:
        """The FP8 weights of a checkpoint whose config says ``fp8`` (each checked), by the codes' name; their
        activation scales dropped. An F8 weight with a scale where the config says no FP8 format is refused: its
        blocks are the config's to say."""
        quantization = planning.quantization or {}
        if cls is DequantizeFp8 and not any(f.reads_config(quantization) for f in FP8_FORMATS):
            fp8.unconfigured(planning.tensors)
        if cls.format.reads_config(quantization):
            problem = cls.format.config_problem(quantization)
            if problem is not None:
                raise CheckpointError(f"{planning.folder / 'config.json'}: quantization_config: {problem}")
            found = cls.find_weights(planning, quantization)
            planning.claim({weight.weight.name: cls(weight) for weight in found})
            dropped = cls.activation_names
            planning.consumed.update(name for name in planning.tensors if name.rpartition(".")[2] in dropped)
            # What an FP8 release stores in fp32 beside its bf16 tensors (DeepSeek's router bias) is kept fp32, as
            # DeepSeek's fp8_cast_bf16.py keeps it and transformers loads it (in fp32, from these bytes).
            for name, info in planning.tensors.items():
                if info.dtype == "F32" and name not in planning.consumed and name not in planning.recipes:
                    planning.recipes[name] = Copy(info, keep=True)

    @classmethod
    def find_weights(cls, planning: Planning, quantization: dict) -> list[fp8.WeightFp8]:
        """The checkpoint's weights of this kind's format, checked."""
        return fp8.find_weights(
            planning.tensors, planning.reader, fp8.block_size(quantization), fp8.ue8m0(quantization)
        )

    def scale_values(self, reader, out_code: str):
        """(the scales as the multiply takes them, their safetensors dtype): as stored."""
        return reader.tensor(self.weight.scale), self.weight.scale.dtype

    def produce(self, tensor, reader, route) -> Iterator[Piece]:
        """Pieces of whole rows of scale blocks, each with the scale rows it uses: numpy bytes on the host, a tensor
        moved to the GPU once where the route computes there."""
        import torch

        weight = self.weight
        grid = weight.grid
        itemsize = DTYPES[tensor.dtype].itemsize
        scales, scale_code = self.scale_values(reader, tensor.dtype)
        scales = scales.contiguous().reshape(-1)
        if route.gpu:
            scales = scales.to(route.device)
        else:
            scales = scales.view(torch.uint8).numpy().reshape(-1, DTYPES[scale_code].itemsize)
        columns = grid.columns
        for first, count in grid.pieces(route.piece_bytes // max(1, columns * itemsize)):
            begin, rows = grid.scale_span(first, count)
            used = scales[begin * grid.scale_columns : (begin + rows) * grid.scale_columns]
            arguments = dict(
                grid=grid, first_row=first, code=weight.weight.dtype, out_code=tensor.dtype, name=tensor.name
            )
            if route.gpu:
                make = route.make(None, functools.partial(dequantize_on_device, scales=used, **arguments))
            else:
                host = functools.partial(fp8.host, scales=used.reshape(-1), scale_code=scale_code, **arguments)
                make = route.make(host)
            yield Piece(
                first * columns * itemsize,
                count * columns * itemsize,
                weight.weight,
                first * columns,
                count * columns,
                make,
                on_device=True,
            )


def dequantize_on_device(
    codes, out, *, scales, grid: fp8.Grid, first_row: int, code: str, out_code: str, name: str = ""
):
    """Whole rows of an FP8 weight (its codes' bytes, a uint8 tensor on the GPU) from ``first_row``, dequantized with
    the scale rows they use (on the GPU) as ``out_code``. Returns the bytes made, a uint8 tensor on the GPU."""
    import torch

    fp8.check_codes(codes, code, name)
    rows = codes.numel() // max(1, grid.columns)
    values = codes.view(DTYPES[code].torch).view(rows, grid.columns)
    made = fp8.dequantize(values, scales, grid, first_row, DTYPES[out_code].torch)
    return made.reshape(-1).view(torch.uint8)
