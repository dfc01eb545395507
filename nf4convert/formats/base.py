"""What a source format says of itself (how config.json and a Hub name show its checkpoints, which tensors are its,
what the model card and messages call it), the registry each format joins where it is defined, and what the rest of
the program asks of all formats at once (the planner's reads, a checkpoint refused by its config, a name's suffix).

A format's module owns its recognition, parsing and checks, and its arithmetic; it imports nothing above
``formats/`` (the kind that dequantizes it imports it). Adding a format is adding its module here (a ``SourceFormat``
subclass under ``@register``) and the kind that dequantizes its weights in ``kinds/``: nothing else lists it.
"""

from __future__ import annotations

import re
from typing import ClassVar

from ..registry import Registry


class SourceFormat:
    """A quantized checkpoint format: everything about it that does not depend on a checkpoint's tensors. Its weights
    are found, checked and dequantized by the kind whose ``format`` it is."""

    name: ClassVar[str]  # "bnb-4bit": the registry's key, and how the model card's format line names it
    family: ClassVar[str]  # what messages call its checkpoints ("bitsandbytes")
    title: ClassVar[str]  # how the model card names it ("bitsandbytes 4-bit")
    quant_methods: ClassVar[tuple[str, ...]]  # config.json's quantization_config.quant_method values it reads
    name_suffix: ClassVar[str]  # regex (no anchors) of the suffix a Hub name carries; the default output drops it
    plan_reads: ClassVar[re.Pattern]  # tensors whose bytes a plan reads (a Hub dry run range-reads just these)
    marks: ClassVar[str]  # what makes a tensor one of its weights, for one claimed twice ("an 8-bit SCB")
    card_tags: ClassVar[frozenset[str]] = frozenset()  # a source card's tags (lowercased) that describe its weights
    card_fields: ClassVar[str] = ""  # regex of a source card's YAML fields (lowercased) that describe its quantization

    @classmethod
    def reads_config(cls, quantization_config: dict) -> bool:
        """Whether a config.json's ``quantization_config`` is one this format's checkpoints carry."""
        method = quantization_config.get("quant_method")
        return isinstance(method, str) and method.lower() in cls.quant_methods

    @classmethod
    def config_problem(cls, quantization_config: dict) -> str | None:
        """Why a ``quantization_config`` it reads says the checkpoint holds nothing to dequantize, or holds what it
        cannot read (None where it may hold its weights)."""
        return None

    @classmethod
    def claims_config(cls, quantization_config: dict) -> bool:
        """Whether a ``quantization_config`` it reads names weights of this format in particular (a compressed-tensors
        config group stored its way), not only a quant_method that other formats read too: where every reader finds
        a problem, the claiming one's is the refusal."""
        return cls.reads_config(quantization_config)

    @classmethod
    def is_quantization_key(cls, tensor_name: str) -> bool:
        """Whether a tensor so named is one only its quantized checkpoints hold (a quant state, a scale)."""
        raise NotImplementedError

    @classmethod
    def exactness(cls, dtype_flag: str, several: bool) -> str:
        """The model card's sentence on what its dequantized weights are, bit for bit, in ``dtype_flag`` ("bf16");
        ``several``: the output was made from more than one format."""
        raise NotImplementedError


_REGISTRY = Registry(__package__, "source format", "name")
register = _REGISTRY.register  # class decorator: the format joins the registry under its ``name``


def all_formats() -> dict[str, type[SourceFormat]]:
    """Every registered format by name, in name order; the first call imports each module of ``formats/``, which
    registers what it defines."""
    return dict(sorted(_REGISTRY.discovered().items()))


def families() -> str:
    """The registered formats' families as a message names them ("bitsandbytes"; "AWQ, bitsandbytes or GPTQ")."""
    named = sorted(dict.fromkeys(source_format.family for source_format in all_formats().values()), key=str.lower)
    return named[0] if len(named) == 1 else f"{', '.join(named[:-1])} or {named[-1]}"


def plan_reads() -> re.Pattern:
    """Every source tensor whose bytes a plan reads, by name, whatever its format. A reader given a headers-only copy
    refuses any other bytes, so a format that reads more without saying so fails that dry run in one line, never
    plans from zeros."""
    return re.compile("|".join(f"(?:{f.plan_reads.pattern})" for f in all_formats().values()))


def name_suffix() -> re.Pattern:
    """A quantization suffix at the end of a model's name ("-bnb-4bit", "-int8"), in any case."""
    return re.compile(f"-(?:{'|'.join(f.name_suffix for f in all_formats().values())})$", re.IGNORECASE)


def quantization_key(tensor_name: str) -> type[SourceFormat] | None:
    """The format whose quantized checkpoints alone hold a tensor so named (None: a dense checkpoint may)."""
    return next((f for f in all_formats().values() if f.is_quantization_key(tensor_name)), None)


def config_reason(config: dict) -> str | None:
    """Why a checkpoint's config.json says it holds nothing any registered format dequantizes (None where it may hold
    something). transformers writes a ``quantization_config`` into config.json when it saves a quantized model."""
    from ..model.config import quantization_configs

    found = quantization_configs(config)
    if not found:
        return "config.json has no quantization_config: the weights are not quantized (already dense?)"
    if not any(f.reads_config(quantization) for quantization in found for f in all_formats().values()):
        method = found[0].get("quant_method")
        return (
            f"config.json's quantization_config has quant_method {method!r}, which nf4convert does not read (it reads "
            f"{families()})"
        )
    return config_problem(config)


def config_problem(config: dict) -> str | None:
    """Where each ``quantization_config`` of a config.json is read by formats that each find a problem with it (it
    says they hold nothing to dequantize, or what they cannot read), the first such problem, as the format that
    claims it words it (``claims_config``); else None."""
    from ..model.config import quantization_configs

    found = quantization_configs(config)
    problems = [_problem(quantization) for quantization in found]
    return problems[0] if found and all(problems) else None


def _problem(quantization: dict) -> str | None:
    readers = [f for f in all_formats().values() if f.reads_config(quantization)]
    problems = {f: f.config_problem(quantization) for f in readers}
    if not readers or not all(problems.values()):
        return None
    claiming = [f for f in readers if f.claims_config(quantization)]
    return problems[(claiming or readers)[0]]
