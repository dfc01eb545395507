"""What a run killed outright (``kill -9``, the out-of-memory killer) leaves, its hidden staging folder beside OUT: a
later run and a dry run name it, and a run into that OUT removes it and says so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from nf4convert.cli.commands import main

from fixtures.processes import package_env

pytest.importorskip("bitsandbytes")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama-bnb-4bit"
KILLED = """
import os, signal, sys
from nf4convert.kinds.copy import Copy
original, calls = Copy.produce, [0]
def producer(*args):
    calls[0] += 1
    if calls[0] == 3:  # halfway through the shards: no chance to clean up
        os.kill(os.getpid(), signal.SIGKILL)
    yield from original(*args)
Copy.produce = producer
from nf4convert.cli.commands import main
main(sys.argv[1:])
"""


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output + result.stderr
    return result.stdout, result.stderr


def test_a_killed_runs_staging_folder_is_named_then_removed_by_a_run_into_its_out(tmp_path, monkeypatch):
    # it stayed, unnamed, until a run into the same OUT removed it without a word
    env = package_env()
    killed = subprocess.run(
        [sys.executable, "-c", KILLED, str(EXAMPLE), "-o", str(tmp_path / "out"), "-q", "--device", "cpu"],
        env={**env, "NF4CONVERT_PROCESSES": "0"},
        capture_output=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL
    (leftover,) = tmp_path.glob(".out.nf4convert-partial-*")
    pid = leftover.name.split("-")[-2]  # the name ends with the pid and a random token
    killed_by = f"{leftover}: left by a conversion that was killed (process {pid} is gone)"
    monkeypatch.chdir(tmp_path)

    plan, _ = run(EXAMPLE, "-o", tmp_path / "other", "--dry-run")
    assert f"leftover: {killed_by}; remove it with: rm -rf {leftover}\n" in plan
    plan, _ = run(EXAMPLE, "-o", tmp_path / "out", "--dry-run")
    assert f"leftover: {killed_by}; a conversion into its OUT removes it, or: rm -rf {leftover}\n" in plan
    _, warnings = run(EXAMPLE, "-o", tmp_path / "other", "-q", "--device", "cpu")
    assert warnings == f"Warning: {killed_by}; remove it with: rm -rf {leftover}\n"
    _, warnings = run("batch", EXAMPLE, "-o", tmp_path, "-q", "--device", "cpu")  # named once, whatever the rows
    assert warnings.count(str(leftover)) == 2 and leftover.is_dir()
    assert sorted(path.name for path in tmp_path.iterdir()) == [leftover.name, "other", "tiny-llama-bf16"]

    _, warnings = run(EXAMPLE, "-o", tmp_path / "out", "-q", "--device", "cpu")
    removed = f"Warning: removed {leftover}, left by a conversion that was killed (process {pid} is gone)\n"
    assert warnings == removed and not leftover.exists() and (tmp_path / "out" / "model.safetensors").exists()
    plan, _ = run(EXAMPLE, "-o", tmp_path / "again", "--dry-run")
    assert "leftover" not in plan


def test_a_running_conversions_folder_and_other_hidden_folders_are_not_named(tmp_path):
    running = tmp_path / f".a.nf4convert-partial-{os.getpid()}"  # this process runs: its folder is in use
    running.mkdir()
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".b.nf4convert-partial-x").mkdir()  # not a process number
    (tmp_path / ".c.nf4convert-partial-4194301").write_text("a file")  # not a folder
    plan, _ = run(EXAMPLE, "-o", tmp_path / "out", "--dry-run")
    assert "leftover" not in plan
