"""User-given names as paths: a name no file system takes is one line naming it, wherever it is given."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from nf4convert.cli.commands import main
from nf4convert.errors import ArgumentError
from nf4convert.paths import expanded

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
LONG = "x" * 256  # one byte past what Linux's and macOS's file systems take in a name


def _one_line(args, code):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == code and len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [
        [EXAMPLE, "-o", LONG],  # the output's checks looked at it first
        [EXAMPLE, "-o", f"a/{LONG}/b", "--dry-run"],  # a dry run said "enough" where the run failed
        ["verify", LONG, EXAMPLE],
        [LONG],  # the check for a mistyped command looked at it as a SOURCE
        [f"{LONG}/b", "-o", "out"],
        [EXAMPLE, "--adapter", LONG, "-o", "out"],
        ["batch", LONG, "-o", "root"],
        ["batch", EXAMPLE, "-o", f"root/{LONG}"],
    ],
    ids=[
        "output",
        "output-dry-run",
        "verify",
        "source-alone",
        "source-inside",
        "adapter",
        "batch-source",
        "batch-root",
    ],
)
def test_a_name_too_long_for_any_file_system_is_one_line(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _one_line(args, 2)
    assert LONG in line and "256 bytes long; a file system takes at most 255" in line
    assert list(tmp_path.iterdir()) == []


def test_a_path_past_the_systems_length_limit_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    deep = "/".join(["y" * 200] * 25)  # every name fits, the whole path does not
    line = _one_line([EXAMPLE, "-o", deep], 2)
    assert line == f"Error: {deep}: File name too long"
    assert list(tmp_path.iterdir()) == []


def test_a_path_that_cannot_be_looked_at_names_itself(monkeypatch):
    import errno

    def refused(path, *args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "lstat", refused)
    with pytest.raises(Exception, match=r"^src: cannot be looked at \(Input/output error\)$") as raised:
        expanded("src", "source")
    assert type(raised.value).__name__ == "SourceNotFoundError"
    with pytest.raises(Exception, match=r"^out: cannot be looked at") as raised:
        expanded("out", "output")
    assert type(raised.value).__name__ == "OutputError"
    with pytest.raises(ArgumentError, match="embedded null byte"):
        monkeypatch.undo()
        expanded("a\x00b", "source")
