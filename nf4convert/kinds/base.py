"""What every tensor kind says of itself: the interface the planner, the pipeline and verify ask through, so that none
of them needs to know which kinds there are; the registry each kind joins where it is defined; what a kind plans
from (``Planning``); a planned output tensor, which carries its recipe; and a tensor made whole from its recipe's
pieces.

Adding a kind is adding its module here (a ``Recipe`` subclass under ``@register``, planning itself in its hooks and
bringing its compute) and its reference in ``verification/reference/`` under the same name: nothing else lists it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, NamedTuple

from ..dtypes import DTYPES
from ..errors import CheckpointError
from ..pipeline.piece import Piece, read_piece
from ..registry import Registry
from ..safetensors_io.read import TensorInfo, TensorReader
from ..strict_json import shown

if TYPE_CHECKING:
    from ..dtypes import DType
    from ..formats.base import SourceFormat


class Recipe:
    """How one output tensor is made. A *leaf* recipe reads source tensors (a copy, a dequantization); a *wrapper*
    (a transpose, a merge) makes its ``base`` recipe's tensor and changes it (``base`` is a wrapper's own field).

    A kind plans itself: the planner calls every registered kind's ``plan_source`` in ``order`` (claim the
    checkpoint's weights of a format, wrap some, copy the rest), then, once the output dtype is chosen, every kind's
    ``plan_output`` (merge an adapter), then ``plan_files`` and ``plan_config``: what it changes beside the tensors
    (a merge's tokenizer and vocabulary), its record of which is its own (``Planning.merged``). A kind brings its
    compute: ``produce`` cuts its tensor into pieces and gives each the route's ``make`` of its own module-level
    functions (``pipeline/routes/``)."""

    kind: ClassVar[str]  # the registry's key, and the name of the kind's module here and in verification/reference/
    label: ClassVar[str]  # how a plan and a summary name what was done ("dequantized from 4-bit")
    format: ClassVar[type[SourceFormat] | None] = None  # the source format a leaf dequantizes (None: plain, wrapper)
    order: ClassVar[int] = 0  # when its planning hooks run among the kinds', lowest first
    plain: ClassVar[bool] = False  # a source tensor's bytes, cast at most: needs no GPU (written first)
    numpy_made: ClassVar[bool] = False  # the CPU route makes it without torch (numpy alone)
    uses_kernel: ClassVar[bool] = False  # made by the fused 4-bit kernel (the CUDA route warms it up first)
    is_quantized: ClassVar[bool] = False  # a leaf that dequantizes a quantized weight (as quantized: (out, in))
    merges_adapter: ClassVar[bool] = False  # adds an adapter's change to its base (verify counts it, checks its ±inf)

    @classmethod
    def plan_source(cls, planning: "Planning") -> None:
        """Plan from the checkpoint's headers: claim the tensors this kind makes, wrap recipes, fill the rest."""

    @classmethod
    def plan_output(cls, planning: "Planning") -> None:
        """Plan once the output dtype is chosen (``planning.dtype``): wrap recipes that depend on it."""

    @classmethod
    def plan_config(cls, planning: "Planning", config: dict) -> dict:
        """The output's config.json (dense already) as what this kind planned changes it: unchanged by default."""
        return config

    @classmethod
    def plan_files(cls, planning: "Planning", files: "SideFiles") -> "SideFiles":
        """The output's files beside its weights as what this kind planned changes them: unchanged by default."""
        return files

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
        """Whether it starts from a quantized weight."""
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
        """The source format it came in, as the model card names it ("bnb-4bit nf4")."""
        return None

    def produce(self, tensor: "PlannedTensor", reader: "TensorReader", route) -> "Iterator[Piece]":
        """The pieces that make ``tensor`` (this recipe's planned tensor) on ``route``."""
        raise NotImplementedError


_REGISTRY = Registry(__package__, "kind", "kind")
register = _REGISTRY.register  # class decorator: the kind joins the registry under its ``kind``, which names its module


@dataclass(frozen=True)
class QuantizedWeight(Recipe):
    """A leaf that dequantizes one weight its format found (``weight``: the format's record of it, with its ``name``,
    dequantized ``shape`` and the ``sources`` it reads): what every such kind answers alike. A kind says where it
    differs (the dtype it was quantized from, whether its scales can pass fp16's range, how a card names it)."""

    is_quantized: ClassVar[bool] = True
    weight: Any

    @property
    def sources(self) -> tuple:
        return self.weight.sources

    def output(self, dtype: "DType") -> tuple[str, str, tuple]:
        return self.weight.name, dtype.code, self.weight.shape

    def exceeds_fp16(self) -> bool:
        return True  # codes times float scales of their own dtype: fp16's range says nothing of them

    @property
    def source_format(self) -> str | None:
        return self.format.name


@dataclass(frozen=True)
class IntegerWeight(QuantizedWeight):
    """A leaf that dequantizes integer codes times scales kept in the model's dtype (GPTQ, AWQ, compressed-tensors
    integers; the scales' dtype is ``weight.dtype``): that is the dtype it was quantized from, and the product of an
    fp16 scale and a small integer code stays within fp16's range."""

    def exceeds_fp16(self) -> bool:
        return self.weight.dtype != "F16"

    @property
    def quantized_from(self) -> str | None:
        return DTYPES[self.weight.dtype].name


def all_kinds() -> dict[str, type[Recipe]]:
    """Every registered kind by name, in planning ``order``; the first call imports each module of ``kinds/``, which
    registers what it defines."""
    return dict(sorted(_REGISTRY.discovered().items(), key=lambda item: (item[1].order, item[0])))


@dataclass
class Planning:
    """What the kinds plan from and into: the checkpoint's headers and config, and the recipes so far.

    ``recipes`` maps each recipe's *anchor* (the source tensor it is placed by: a weight's packed or int8 tensor, a
    plain tensor itself) to the recipe. Once the sources are planned the planner puts them in the order of their
    anchors' files and offsets (so reads stay sequential); a ``plan_output`` hook keeps that order, and a tensor it
    adds goes where it inserts it."""

    folder: Path
    tensors: dict[str, TensorInfo]  # every source tensor, by name
    reader: TensorReader  # for the few small tensors a plan reads (quant states, scales)
    config: dict | None  # config.json, if any
    quantization: dict | None  # its quantization_config
    adapter: Any = None  # a peft adapter to merge in: its folder, or as read (``adapters.lora.Adapter``)
    recipes: dict[str, Recipe] = field(default_factory=dict)
    consumed: set[str] = field(default_factory=set)  # the source tensors claimed recipes read
    dtype: DType | None = None  # the output's floating dtype: None until chosen (after every plan_source)
    merged: Any = None  # what merging an adapter did beyond the tensors (kinds/merge_lora.py: Merged)
    keep_non_finite: bool = False  # the NaN or ±inf values a merge makes: kept, not refused (allow_non_finite)

    def claim(self, claimed: dict[str, Recipe]) -> None:
        """Add a format's leaf recipes (anchor -> recipe): the weights it found in the checkpoint, each checked.
        CheckpointError for an anchor another format claimed already (the first in name order)."""
        for anchor in sorted(claimed.keys() & self.recipes.keys()):
            first, second = self.recipes[anchor].innermost().format, claimed[anchor].format
            raise CheckpointError(
                f"{self.tensors[anchor].path}: tensor {shown(anchor)} has both {first.marks} and {second.marks}; "
                "it is one or the other"
            )
        self.recipes.update(claimed)
        self.consumed.update(source.name for recipe in claimed.values() for source in recipe.sources)


class Added(NamedTuple):
    """A file an output holds that is not the source's: copied from ``path``, named in verify's findings as
    ``named`` ("the adapter's tokenizer file"), compared with ``owner``'s ("the adapter's")."""

    path: Path
    named: str
    owner: str


@dataclass(frozen=True)
class SideFiles:
    """The files an output holds beside its weights: ``carried`` from the source (relative to its folder), and
    ``added`` by a kind (relative to the output -> what it is copied from)."""

    carried: list[Path]
    added: dict[Path, Added] = field(default_factory=dict)


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
    transpose or a merge needs (and the GGUF feed, for a tensor it did not make ahead). On the CPU route its pieces
    are made on as many threads as the route has makers (each into its own bytes), on a GPU one after another."""
    import torch

    made = torch.empty(tensor.nbytes, dtype=torch.uint8, device=device)

    def make(piece):
        read = read_piece(reader, piece)
        target = made[piece.offset : piece.offset + piece.nbytes]
        if piece.make is None:
            target.copy_(read)
        else:
            route.make_into(piece, read, target)

    pieces = tensor.recipe.produce(tensor, reader, route)
    threads = 1 if route.gpu else route.makers
    if threads <= 1:
        for piece in pieces:
            make(piece)
        return made
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(threads, thread_name_prefix="nf4convert-whole", initializer=route.maker_started)
    try:
        for done in [pool.submit(make, piece) for piece in pieces]:
            done.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # after a failure, the pieces not begun are not made
    return made
