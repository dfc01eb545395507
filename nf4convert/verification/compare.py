"""One output tensor against its reference, bit for bit."""

from __future__ import annotations

from ..errors import CheckpointError
from ..safetensors_io.read import TensorInfo
from .reference import blame


def compare(tensor, info: TensorInfo, source_reader, output_reader, device, report, context) -> str | None:
    """What is wrong with output tensor ``info`` against ``tensor``'s reference, or None; counts it in ``report``."""
    if info.dtype != tensor.dtype or tuple(info.shape) != tuple(tensor.shape):
        return f"{info.dtype} {list(info.shape)} in the output, {tensor.dtype} {list(tensor.shape)} expected"
    who = blame(tensor)
    if not tensor.recipe.plain:
        report.dequantized += 1
        report.merged += tensor.recipe.kind == "merge_lora"
    try:
        expected = context.recompute(tensor, source_reader, device).to("cpu")
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001  (the reference library refused this input: a finding, not a crash)
        return (
            f"{who} could not recompute it ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        )
    got = output_reader.tensor(info)
    differ = _bits(got) != _bits(expected)
    mismatches = int(differ.sum())
    return f"{mismatches} of {got.numel()} elements differ from {who}" if mismatches else None


def _bits(tensor):
    import torch

    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(-1).view(integer)
