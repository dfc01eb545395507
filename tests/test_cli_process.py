"""The command as a process meets it: the console script that pip writes, stop signals from its first statement on,
and a standard output whose reader went away (``| head``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.processes import default_stop_signals, package_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama-bnb-4bit"
# pip's console-script wrapper (distlib's template), around the entry point pyproject.toml names
CONSOLE_SCRIPT = """# -*- coding: utf-8 -*-
import re
import sys
from {module} import {function}
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit({function}())
"""


def _console_script(folder: Path) -> Path:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    module, function = re.search(r'^nf4convert = "([\w.]+):(\w+)"$', pyproject, re.MULTILINE).groups()
    script = folder / "nf4convert"
    script.write_text(CONSOLE_SCRIPT.format(module=module, function=function))
    return script


def _landed_before_the_script(returncode: int, stderr: str, signum: int, script: Path) -> bool:
    """Whether a signal came before the console script's package could act: killed before Python set its own handler,
    failing Python's own start-up ("Fatal Python error", site's imports), or a KeyboardInterrupt raised by the import
    machinery, the wrapper or the package's first modules (nf4convert/__init__.py, entry.py) before entry.py's
    handlers were set. Nothing of ours has run then; the test sends such a signal again."""
    if returncode == -signum and not stderr:
        return True
    if "Fatal Python error" in stderr:
        return True
    if "Traceback" not in stderr:
        return False
    ours_before = re.compile(
        rf'File "(<frozen [^>]+>|{re.escape(str(script))}|{re.escape(str(ROOT / "nf4convert"))}/(__init__|entry)\.py)"'
    )
    frames = [line for line in stderr.splitlines() if line.lstrip().startswith("File ")]
    return all(ours_before.search(frame) for frame in frames)


def _stop_at(script: Path, out: Path, signum: int, delay: float) -> tuple[int, str]:
    process = subprocess.Popen(
        [sys.executable, str(script), str(EXAMPLE), "-o", str(out), "-q", "--device", "cpu"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=package_env(),
        preexec_fn=default_stop_signals,
    )
    try:
        process.wait(delay)
    except subprocess.TimeoutExpired:
        process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, stderr


@pytest.mark.parametrize(
    "signal_name,word", [("SIGINT", "interrupted"), ("SIGTERM", "terminated"), ("SIGHUP", "terminated")]
)
def test_a_stop_signal_from_the_console_scripts_first_statement_is_never_a_traceback(tmp_path, signal_name, word):
    # a Ctrl-C while the command line was starting (its imports) was a KeyboardInterrupt traceback
    signum = getattr(signal, signal_name)
    script = _console_script(tmp_path)
    seen = set()
    early, late = 0.0, None  # the latest delay that came before the script, the earliest that stopped a run
    delays = [0.002 * 2**k for k in range(10)]
    for attempt in range(40):
        if not delays:
            if "start-up" in seen or late is None:
                break
            delays = [(early + late) / 2]  # look for the start-up between the two
        delay = delays.pop(0)
        out = tmp_path / f"out-{attempt}"
        returncode, stderr = _stop_at(script, out, signum, delay)
        if _landed_before_the_script(returncode, stderr, signum, script):
            early = max(early, delay)
            continue
        assert "Traceback" not in stderr and returncode in (0, 128 + signum), (delay, returncode, stderr)
        if returncode == 0:  # finished before the signal
            assert (out / "model.safetensors").exists()
            late = delay if late is None else min(late, delay)
            continue
        assert not out.exists() and not list(tmp_path.glob(".out*")), stderr  # nothing half-written
        if stderr == "":
            seen.add("start-up")  # before the command line's own handlers: a quiet exit
        else:
            # a Ctrl-C that lands in click's own parsing comes after the blank line click closes a terminal's ^C with
            expected = f"Error: {word}; nothing was written\n"
            assert stderr in (expected, "\n" + expected) if signum == signal.SIGINT else stderr == expected, stderr
            seen.add("run")
            late = delay if late is None else min(late, delay)
    assert seen == {"start-up", "run"}, seen


def _with_stdout_closed(args, cwd: Path) -> subprocess.CompletedProcess:
    """The command with a standard output whose reader has gone (``nf4convert ... | head -1`` once head has its line):
    every write to it fails with EPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "nf4convert", *map(str, args)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=package_env(),
            cwd=cwd,
            timeout=600,
        )
    finally:
        os.close(write)


def test_a_standard_output_nobody_reads_is_no_error_and_the_run_keeps_its_status(tmp_path):
    # "nf4convert batch ... | head -1" said "cannot print to standard output (Broken pipe)" and exited 1
    cases = [
        (["batch", EXAMPLE, "-o", "root", "-q"], 0, ""),
        (["batch", EXAMPLE, "missing", "-o", "root2", "-q", "--json"], 1, "1 of 2 failed\n"),  # its own status
        ([EXAMPLE, "-o", "out", "-q", "--device", "cpu"], 0, ""),
        (["verify", "out", EXAMPLE, "-q", "--device", "cpu"], 0, ""),
        ([EXAMPLE, "-o", "planned", "--dry-run"], 0, ""),
        (["--help"], 0, ""),
    ]
    for args, code, stderr in cases:
        result = _with_stdout_closed(args, tmp_path)
        assert (result.returncode, result.stderr) == (code, stderr), (args, result.stderr)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "root", "root2"]  # nothing hidden, half-written
    assert [path.name for path in (tmp_path / "root").iterdir()] == ["tiny-llama-bf16"]
    assert (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "stop,code,word",
    [("Interrupted", 130, "interrupted"), ("KeyboardInterrupt", 130, "interrupted"), ("Terminated", 143, "terminated")],
)
def test_a_stop_in_clicks_own_code_is_a_stopped_run_not_aborted(monkeypatch, tmp_path, stop, code, word):
    # click turns a Ctrl-C in its parsing into Abort ("Error: aborted", exit 1); a SIGTERM there was a traceback
    from click.testing import CliRunner

    from nf4convert import errors
    from nf4convert.cli import commands as cli

    raised = getattr(errors, stop, None) or KeyboardInterrupt

    def stopped(ctx, param, value):
        raise raised()

    monkeypatch.chdir(tmp_path)
    quiet = next(param for param in cli.main.commands["convert"].params if param.name == "quiet")
    monkeypatch.setattr(quiet, "callback", stopped)  # an option's callback: runs inside click's parsing
    result = CliRunner().invoke(cli.main, [str(EXAMPLE), "-o", "out", "-q"])
    lines = [line for line in result.output.splitlines() if line]  # click closes a terminal's ^C with a blank line
    assert (result.exit_code, lines) == (code, [f"Error: {word}; nothing was written"]), result.output


# The console script run as Python runs it, noting each module looked for while SIGINT is Python's KeyboardInterrupt.
_WATCHED = """
import signal, sys
seen = []

class Watch:
    def find_spec(self, name, path=None, target=None):
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler and name not in seen:
            seen.append(name)
            print("under Python's handler:", name, file=sys.stderr, flush=True)  # the command may end by os._exit
        return None

sys.meta_path.insert(0, Watch())
script = sys.argv[1]
sys.argv = [script, "--version"]
exec(compile(open(script).read(), script, "exec"), {"__name__": "__main__"})
"""


def test_what_runs_before_the_stop_handlers_is_what_the_reference_says(tmp_path):
    """A Ctrl-C before the entry module's handlers is Python's own traceback: docs/cli.md names what runs until then
    (after Python's start-up), and that is all that runs: the package's two first modules and the entry module."""
    script = _console_script(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", _WATCHED, str(script)], capture_output=True, text=True, env=package_env(), timeout=120
    )
    assert result.returncode == 0 and "version" in result.stdout, result.stderr
    prefix = "under Python's handler: "
    measured = [line.removeprefix(prefix) for line in result.stderr.splitlines() if line.startswith(prefix)]
    reference = " ".join((ROOT / "docs" / "cli.md").read_text(encoding="utf-8").split())
    said = re.search(r"the console script's imports of ((?:`[\w.]+`(?:, | and )?)+)", reference)
    assert said is not None, "docs/cli.md no longer says what runs before the handlers"
    assert (
        re.findall(r"`([\w.]+)`", said.group(1)) == measured == ["nf4convert", "nf4convert.cli", "nf4convert.cli.entry"]
    )
