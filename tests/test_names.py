"""Names as a user's shell passes them: bytes that are not UTF-8 in SOURCE or OUT (a Latin-1 folder name) convert,
with a card that is UTF-8 text whose command names the same paths, and errors that show such a byte as ``\\xNN``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.processes import package_env

pytest.importorskip("bitsandbytes")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
SOURCE = os.fsdecode(b"src/bad\xff-bnb-4bit")


def nf4convert(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "nf4convert", *args],
        cwd=cwd,
        env=package_env(),
        capture_output=True,
        timeout=600,
    )


@pytest.fixture
def source(tmp_path) -> Path:
    folder = tmp_path / SOURCE
    shutil.copytree(EXAMPLE, folder)
    return folder


def card(folder: Path) -> str:
    return (folder / "README.md").read_bytes().decode("utf-8")  # strict: a card is UTF-8 text


def test_a_source_and_an_output_named_in_bytes_that_are_not_utf8_convert(source, tmp_path):
    done = nf4convert(SOURCE, "-q", "--device", "cpu", cwd=tmp_path)
    assert done.returncode == 0 and not done.stderr, done.stderr.decode(errors="replace")
    output = tmp_path / os.fsdecode(b"bad\xff-bf16")
    text = card(output)
    assert (
        "# bad\\xff-bf16\n" in text
        and "\nnf4convert $'src/bad\\xff-bnb-4bit' --dtype bf16 -o $'bad\\xff-bf16'\n" in text
    )
    # the card's command, run by bash, names the same source
    named = subprocess.run(["bash", "-c", "ls -d $'src/bad\\xff-bnb-4bit'"], cwd=tmp_path, capture_output=True)
    assert named.returncode == 0 and named.stdout.strip() == os.fsencode(SOURCE)
    verified = nf4convert("verify", os.fsdecode(b"bad\xff-bf16"), SOURCE, cwd=tmp_path)
    assert verified.returncode == 0 and b"\nOK: bit-exact" in verified.stdout, verified.stderr

    out = os.fsdecode(b"out\xfe")
    done = nf4convert(SOURCE, "-o", out, "-q", "--device", "cpu", cwd=tmp_path)
    assert done.returncode == 0 and not done.stderr, done.stderr.decode(errors="replace")
    assert "# out\\xfe\n" in card(tmp_path / out)

    done = nf4convert("batch", SOURCE, "-o", "root", "-q", "--device", "cpu", "--json", cwd=tmp_path)
    assert done.returncode == 0 and not done.stderr, done.stderr.decode(errors="replace")
    row = json.loads(done.stdout)
    assert row["status"] == "ok" and row["output"] == os.fsdecode(b"root/bad\xff-bf16")
    assert "# bad\\xff-bf16\n" in card(tmp_path / row["output"])


def test_an_error_shows_a_byte_that_is_not_utf8_as_an_escape(tmp_path):
    done = nf4convert(os.fsdecode(b"nope\xff"), "-q", cwd=tmp_path)
    assert done.returncode == 1 and done.stderr.decode("utf-8").startswith("Error: nope\\xff: no such folder")


def test_a_batch_checks_a_long_name_as_it_will_be_not_with_its_placeholder(tmp_path):
    """With --dtype auto the output's name is ``<name>-<dtype>`` until planned: the length a file system allows is
    checked on the name as it will be written (``<name>-bf16``), not on the placeholder."""
    fits, too_long = "m" * 250, "n" * 251  # + "-bf16": 255 bytes, the most a file name has, and 256
    for name in (fits, too_long):
        shutil.copytree(EXAMPLE, tmp_path / name)
    done = nf4convert("batch", fits, "-o", "root", "-q", "--device", "cpu", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)
    assert row["status"] == "ok" and row["output"] == f"root/{fits}-bf16", row
    assert (tmp_path / "root" / f"{fits}-bf16" / "model.safetensors").is_file()
    refused = nf4convert("batch", too_long, "-o", "root", "-q", "--device", "cpu", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.decode().endswith(
        f"{too_long}-bf16: a name in it is 256 bytes long; a file system takes at most 255\n"
    ), refused.stderr
