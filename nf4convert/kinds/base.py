"""What every tensor kind says of itself: the interface the planner, the pipeline and verify ask through, so that none
of them needs to know which kinds there are (the registry, ``kinds/__init__.py``, does); a planned output tensor, which
carries its recipe; and a tensor made whole from its recipe's pieces."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Iterator

from ..pipeline.piece import Piece
from ..safetensors_io.read import TensorReader

if TYPE_CHECKING:
    from ..dtypes import DType


class Recipe:
    """How one output tensor is made. A *leaf* recipe reads source tensors (a copy, a dequantization); a *wrapper*
    (a transpose, a merge) makes its ``base`` recipe's tensor and changes it (``base`` is a wrapper's own field)."""

    kind: ClassVar[str]  # the registry's key, and the name of the kind's module here and in verification/reference/
    label: ClassVar[str]  # how a plan and a summary name what was done ("dequantized from 4-bit")
    plain: ClassVar[bool] = False  # a source tensor's bytes, cast at most: needs no GPU (written first)
    numpy_made: ClassVar[bool] = False  # the CPU route makes it without torch (numpy alone)
    uses_kernel: ClassVar[bool] = False  # made by the fused 4-bit kernel (the CUDA route warms it up first)
    is_quantized: ClassVar[bool] = False  # a leaf that dequantizes a bitsandbytes weight (as quantized: (out, in))

    @property
    def sources(self) -> tuple:
        """The source tensors it reads."""
        raise NotImplementedError

    def innermost(self) -> "Recipe":
        """The leaf under any wrappers: what the tensor starts from."""
        recipe = self
        while getattr(recipe, "base", None) is not None:
            recipe = recipe.base
        return recipe

    @property
    def quantized(self) -> bool:
        """Whether it starts from a bitsandbytes weight."""
        return self.innermost().is_quantized

    @property
    def transposed(self) -> bool:
        """Whether it is stored transposed from how it was quantized (a Conv1D weight), under any other wrapper."""
        base = getattr(self, "base", None)
        return base is not None and base.transposed

    def output(self, dtype: "DType") -> tuple[str, str, tuple]:
        """(name, safetensors dtype, shape) of the tensor it makes when the output's floating dtype is ``dtype``."""
        raise NotImplementedError

    def exceeds_fp16(self) -> bool:
        """Whether, written as fp16 (largest 65504), its values may overflow to ±inf."""
        raise NotImplementedError

    def converts_to(self, code: str) -> bool:
        """Whether making it in dtype ``code`` converts floats (a numpy path's cast to fp16 is slow: torch does it)."""
        return True

    @property
    def quantized_from(self) -> str | None:
        """The dtype (torch's name) the source was quantized from, where the checkpoint says (``--dtype auto``)."""
        return None

    @property
    def plain_dtype(self) -> str | None:
        """A plain floating tensor's own dtype (torch's name): ``--dtype auto``'s last resort."""
        return None

    @property
    def source_format(self) -> str | None:
        """The bitsandbytes format it came in, as the model card names it ("bnb-4bit nf4")."""
        return None

    def produce(self, tensor: "PlannedTensor", reader: "TensorReader", route) -> "Iterator[Piece]":
        """The pieces that make ``tensor`` (this recipe's planned tensor) on ``route``."""
        raise NotImplementedError


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor: what it is, where it goes (``offset`` from the start of its shard's data), how it is made."""

    name: str
    dtype: str  # safetensors' name
    shape: tuple
    nbytes: int
    shard: str
    offset: int
    recipe: Recipe


def whole(tensor: PlannedTensor, reader: TensorReader, route, device="cpu"):
    """A planned tensor made whole through ``route``, as raw bytes (a uint8 tensor) in ``device``'s memory: what a
    transpose or a merge needs, and what a sink that takes whole tensors (GGUF) is fed."""
    import torch

    made = torch.empty(tensor.nbytes, dtype=torch.uint8, device=device)
    for piece in tensor.recipe.produce(tensor, reader, route):
        read = reader.read(piece.source, piece.first, piece.count)
        target = made[piece.offset : piece.offset + piece.nbytes]
        if piece.make is None:
            target.copy_(read)
        else:
            route.make_into(piece, read, target)
    return made
