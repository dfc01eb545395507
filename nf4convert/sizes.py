"""Sizes as users write and read them: ``--max-shard-size`` (decimal units, like transformers) and its one default,
and byte counts and counts of things in messages. Imports nothing heavy: the command line's ``--help`` shows the
default."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from .errors import ArgumentError

DEFAULT_SHARD_SIZE = "5GB"  # the one default, as transformers spells it (the CLI and the API show this)


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB', '1.5GB' or a number of bytes -> bytes (decimal units like transformers)."""

    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        units = {
            "": 1,
            "B": 1,
            "KB": 10**3,
            "MB": 10**6,
            "GB": 10**9,
            "TB": 10**12,
            "KIB": 2**10,
            "MIB": 2**20,
            "GIB": 2**30,
            "TIB": 2**40,
        }
        value = str(text).strip().upper()
        number = value.rstrip("KMGTIB")
        try:
            amount = Decimal(number)  # exact: no float rounding of a large byte count
            bytes_ = amount * units[value[len(number) :].strip()] if amount.is_finite() else None
        except (InvalidOperation, KeyError, ValueError):
            bytes_ = None
        if bytes_ is None or bytes_ != bytes_.to_integral_value():  # '1.5' bytes is no size, '1.5GB' is
            raise ArgumentError(
                f"max_shard_size {text!r} is not like '5GB', '500MB' or a whole number of bytes",
                option="max_shard_size",
            )
        size = int(bytes_)
    if size <= 0 or size >= 2**63:
        raise ArgumentError(f"max_shard_size {text!r} must be positive and below 2**63 bytes", option="max_shard_size")
    return size


DEFAULT_SHARD_BYTES = parse_size(DEFAULT_SHARD_SIZE)


def size_text(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def counted(count: int, noun: str) -> str:
    """``count`` with ``noun`` in the number it takes: "1 tensor", "3 tensors"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"
