"""NF4CONVERT_PROFILE=1: where a conversion's time goes (benchmarks/bench_convert.py prints it).

At the end of a conversion, one JSON line on stderr: the process's age (seconds since it started) at each
marked moment of the run, and the pipeline's stages (each stage's busy seconds summed over its threads, and
how long the pipeline's caller waited on it). Off, every call here is a no-op.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

_enabled = [False]  # this run's settings.profile, set by start()
_marks: dict[str, float] = {}
_fields: dict = {}


def process_age() -> float:
    """Seconds since this process started (Linux; 10 ms resolution), or -1."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return float(Path("/proc/uptime").read_text().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return -1.0


def start(moment: str, *, enabled: bool) -> None:
    """A new report (what an earlier run that failed before reporting left is dropped), its first mark ``moment``;
    ``enabled`` is the run's ``Settings.profile`` (off, every call here is a no-op)."""
    _enabled[0] = enabled
    _marks.clear()
    _fields.clear()
    mark(moment)


def mark(moment: str) -> None:
    """Note the process's age now, under ``moment`` (the first time it is reached)."""
    if _enabled[0] and moment not in _marks:
        _marks[moment] = round(process_age(), 3)


def record(**fields) -> None:
    """Fields of the report (the pipeline's stage figures)."""
    if _enabled[0]:
        _fields.update(fields)


def report() -> None:
    """Print the report (once) on stderr."""
    if _enabled[0] and _marks:
        mark("reported")
        print(json.dumps({"profile": {"marks": dict(_marks), **_fields}}), file=sys.stderr, flush=True)
        _marks.clear()
        _fields.clear()
