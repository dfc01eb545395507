"""The NF4CONVERT_* environment variables, read once into a :class:`Settings` (a command's first step, so that a dry
run refuses a bad value as the conversion would, and a batch refuses it once, before any source), then passed to what
uses them. One rule for all: a value that is unset or empty is the default; anything else that is not a whole number
(or, for a switch, 1/on/true/yes or 0/off/false/no) is one line naming the variable. What each does: docs/cli.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from .errors import ArgumentError


@dataclass(frozen=True)
class Settings:
    """What the environment asks of a run; the defaults are what an unset variable means."""

    shards_at_once: int = 4  # NF4CONVERT_SHARDS_AT_ONCE: shards whose pieces are interleaved
    writers: int = 4  # NF4CONVERT_WRITERS: threads writing at once, one per shard written at once
    # NF4CONVERT_MAKERS: the CPU route's threads where it has no worker processes, one per core up to this: the decode
    # is bound by memory and the interpreter's lock well before many cores, and readers and writers need cores too.
    makers: int = 8
    processes: int | None = None  # NF4CONVERT_PROCESSES: the CPU route's worker processes (None: from the cores)
    writeback: bool = True  # NF4CONVERT_WRITEBACK: hand each range written to the disk at once
    profile: bool = False  # NF4CONVERT_PROFILE: one JSON line on stderr saying where a conversion's time went
    fast_launch: bool = True  # NF4CONVERT_FAST_LAUNCH: replay a prepared kernel launch (0: Triton's own launcher)
    stream_memory: int = 256  # NF4CONVERT_STREAM_MEMORY: MiB of a Hub repo's bytes held while streamed (fetched ahead)
    stream_requests: int = 8  # NF4CONVERT_STREAM_REQUESTS: range requests in flight per Hub repo streamed
    push_on_disk: int = 2  # NF4CONVERT_PUSH_ON_DISK: shards on local disk at once in a push with no local copy

    @classmethod
    def from_env(cls, environ=None) -> "Settings":
        """The settings ``environ`` (default: this process's environment) asks for; ArgumentError for a bad value."""
        environ = os.environ if environ is None else environ
        values = {}
        for spec in fields(cls):
            name = f"NF4CONVERT_{spec.name.upper()}"
            text = environ.get(name, "").strip()
            if text:
                values[spec.name] = (
                    _switch(name, text) if isinstance(spec.default, bool) else _whole(name, text, LEAST[spec.name])
                )
        return cls(**values)


LEAST = {
    "shards_at_once": 1,
    "writers": 1,
    "makers": 1,
    "processes": 0,
    "stream_memory": 16,
    "stream_requests": 1,
    "push_on_disk": 1,
}  # the smallest whole number each takes
VARIABLES = tuple(f"NF4CONVERT_{spec.name.upper()}" for spec in fields(Settings))


def _switch(name: str, text: str) -> bool:
    if text.lower() in ("1", "on", "true", "yes"):
        return True
    if text.lower() in ("0", "off", "false", "no"):
        return False
    raise ArgumentError(f"{name}={text!r}: not 1/on/true/yes or 0/off/false/no")


def _whole(name: str, text: str, least: int) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < least:
        raise ArgumentError(f"{name}={text!r}: not a whole number of {least} or more")
    return int(text)
