"""What bitsandbytes' checkpoints share, 4-bit (``bnb4_weights.py``) and 8-bit (``bnb8.py``) alike: how config.json
names them, and the source card's tags and fields that describe them."""

from __future__ import annotations

from typing import ClassVar

from .base import SourceFormat


class Bitsandbytes(SourceFormat):
    """The family's part of a bitsandbytes format (not itself registered: its 4-bit and 8-bit formats are)."""

    family: ClassVar[str] = "bitsandbytes"
    quant_methods: ClassVar[tuple[str, ...]] = ("bitsandbytes",)
    card_tags: ClassVar[frozenset[str]] = frozenset({"bitsandbytes", "bnb"})
    # quant_method, bnb_4bit_compute_dtype, bitsandbytes..., load_in_4bit, load_in_8bit
    card_fields: ClassVar[str] = r"bnb|bitsandbytes|^load_in_\d+bit$"
    only: ClassVar[str]  # the flag of a config.json that is this format's and no other's ("load_in_4bit")
    other: ClassVar[str]  # the flag of the family's other format

    @classmethod
    def reads_config(cls, quantization_config: dict) -> bool:
        """transformers writes ``quant_method`` "bitsandbytes" with ``load_in_4bit`` or ``load_in_8bit``; older
        versions wrote the flags without a ``quant_method`` (read too). A config with neither flag may be either's."""
        method = quantization_config.get("quant_method")
        if isinstance(method, str) and not any(name in method.lower() for name in cls.quant_methods):
            return False
        return not (quantization_config.get(cls.other) is True and quantization_config.get(cls.only) is not True)
