"""The NF4CONVERT_* environment variables: every one is read here, by one rule. A value that is unset or empty is the
default; anything else that is not a whole number (or, for a switch, 1/on/true/yes or 0/off/false/no) is one line
naming the variable. ``check`` reads them all: a command's first step, so that a dry run refuses a bad value as the
conversion would, and a batch refuses it once, before any source."""

from __future__ import annotations

import os

from .errors import ArgumentError

# name: (default, least) for whole numbers, (default,) for switches. What each does: README, "The command line".
KNOBS = {
    "NF4CONVERT_SHARDS_AT_ONCE": (4, 1),
    "NF4CONVERT_WRITERS": (4, 1),
    "NF4CONVERT_MAKERS": (8, 1),
    "NF4CONVERT_PROCESSES": (None, 0),  # None: from the cores
    "NF4CONVERT_WRITEBACK": (True,),
    "NF4CONVERT_PROFILE": (False,),
    "NF4CONVERT_FAST_LAUNCH": (True,),
}


def value(name: str):
    """The knob's value (ArgumentError for a bad one)."""
    default, *least = KNOBS[name]
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not least:
        if text.lower() in ("1", "on", "true", "yes"):
            return True
        if text.lower() in ("0", "off", "false", "no"):
            return False
        raise ArgumentError(f"{name}={text!r}: not 1/on/true/yes or 0/off/false/no")
    if not (text.isascii() and text.isdigit()) or int(text) < least[0]:
        raise ArgumentError(f"{name}={text!r}: not a whole number of {least[0]} or more")
    return int(text)


def check() -> None:
    """Read every knob now: ArgumentError for the first bad one."""
    for name in KNOBS:
        value(name)
