"""A run's temporary (staging) folder is its own by a lock it holds, not by its process number: a run in another PID
namespace (a container) or on another host is never taken for a killed one, two runs that are both PID 1 never share
a folder, and no run removes a folder whose owner is not provably gone. A second Ctrl-C while the folder is removed
does not stop the removal; a folder that could not be removed is named with the command that removes it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from nf4convert.cli.commands import main

from fixtures.processes import default_stop_signals, package_env
from fixtures.staging_folders import killed_run_folder

pytest.importorskip("bitsandbytes")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama-bnb-4bit"
STEM = ".out.nf4convert-partial"


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output + result.stderr
    return result


def _staging_folders(parent: Path) -> list[Path]:
    return sorted(path for path in parent.iterdir() if ".nf4convert-partial-" in path.name)


# A run in another PID namespace, as this one sees it: its folder is named by a process number that does not run
# here, and it holds its folder's lock.
HOLDER = """
import os, sys, time
from pathlib import Path
os.getpid = lambda: 4194301
from nf4convert.sinks import output
with output.staging(Path(sys.argv[1])) as folder:
    (folder / "model.safetensors").write_bytes(b"half written")
    print(folder, flush=True)
    time.sleep(300)
"""


def test_a_live_run_named_by_a_process_number_not_running_here_is_never_taken_for_a_killed_one(tmp_path):
    # its folder was removed with a false "left by a conversion that was killed" warning, and the live run failed
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], env=package_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        theirs = Path(holder.stdout.readline().strip())
        assert theirs.name.startswith(f"{STEM}-4194301-"), theirs
        result = run(EXAMPLE, "-o", out, "-q", "--device", "cpu")
        assert result.stderr == "" and (theirs / "model.safetensors").read_bytes() == b"half written"
        assert "leftover" not in run(EXAMPLE, "-o", tmp_path / "other", "--dry-run").stdout
    finally:
        holder.kill()
        holder.wait()
    # gone now (its lock went with it): named, then removed by a run into its OUT
    killed = f"{theirs}: left by a conversion that was killed (process 4194301 is gone)"
    plan = run(EXAMPLE, "-o", out, "--dry-run", "--overwrite").stdout
    assert f"leftover: {killed}; a conversion into its OUT removes it" in plan
    result = run(EXAMPLE, "-o", out, "-q", "--device", "cpu", "--overwrite")
    assert (
        result.stderr == f"Warning: removed {theirs}, left by a conversion that was killed (process 4194301 is gone)\n"
    )
    assert not _staging_folders(tmp_path)


def test_a_folder_whose_owner_cannot_be_checked_here_is_named_never_removed(tmp_path):
    # another host's (or another boot's) run: this kernel does not hold its lock, so its freedom proves nothing
    theirs = killed_run_folder(tmp_path, STEM, pid=77)
    (theirs / ".nf4convert-owner").write_text("host=elsewhere\nboot=another-boot\npid=77\n")
    older = tmp_path / f"{STEM}-4194302"  # an older version's, named by its process alone
    older.mkdir()
    os.utime(older, (time.time() - 3600, time.time() - 3600))
    result = run(EXAMPLE, "-o", tmp_path / "out", "-q", "--device", "cpu")
    assert theirs.is_dir() and older.is_dir()
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"Warning: {older}: a conversion's temporary folder, whose owner (process 4194302) cannot be checked from "
        f"here; if no conversion into it runs there any more, remove it with: rm -rf {older}",
        f"Warning: {theirs}: a conversion's temporary folder, whose owner (process 77 on host elsewhere) cannot be "
        f"checked from here; if no conversion into it runs there any more, remove it with: rm -rf {theirs}",
    ]


@pytest.fixture(scope="module")
def pid_namespaces():
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("no unshare here")
    if done.returncode != 0:
        pytest.skip(f"unshare --pid is not allowed here: {done.stderr.decode()[-200:]}")


# Run A, paused once it holds its staging folder until the test says go.
PAUSED = """
import pathlib, sys, time
started, go = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def wait(folder):
    started.write_text(str(folder))
    while not go.exists():
        time.sleep(0.05)
try:
    from nf4convert.sinks import ownership
    claim = ownership.Owner.claim.__func__
    def claimed(cls, folder):
        owner = claim(cls, folder)
        wait(folder)
        return owner
    ownership.Owner.claim = classmethod(claimed)
except ImportError:  # a version without owner files: paused once the folder is made
    mkdir = pathlib.Path.mkdir
    def made(self, *args, **kwargs):
        mkdir(self, *args, **kwargs)
        if ".nf4convert-partial-" in self.name:
            wait(self)
    pathlib.Path.mkdir = made
from nf4convert.cli.commands import main
main(sys.argv[3:])
"""


def test_two_runs_that_are_both_pid_1_never_share_or_remove_each_others_folder(tmp_path, pid_namespaces):
    # both as PID 1 (as in containers): the same folder name, and both failed
    out, started, go = tmp_path / "out", tmp_path / "started", tmp_path / "go"
    unshare = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable]
    convert = [str(EXAMPLE), "-o", str(out), "-q", "--device", "cpu"]
    env = package_env(NF4CONVERT_PROCESSES="0")
    first = subprocess.Popen(
        [*unshare, "-c", PAUSED, str(started), str(go), *convert], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        for _ in range(1200):
            if started.exists() and started.read_text():
                break
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.05)
        theirs = Path(started.read_text())
        assert theirs.parent == tmp_path and "-1-" in theirs.name  # PID 1 in its namespace
        second = subprocess.run([*unshare, "-m", "nf4convert", *convert], env=env, capture_output=True, text=True)
        assert second.returncode == 0 and second.stderr == "", second.stderr
        assert theirs.is_dir() and (out / "model.safetensors").is_file()
        go.write_text("go")
        _, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 1 and f"{out}: appeared while converting (another run?)" in stderr, stderr
    assert not _staging_folders(tmp_path)
    assert "OK: bit-exact" in run("verify", out, EXAMPLE, "-q", "--device", "cpu").stdout


# The first Ctrl-C as soon as the staging folder is made; the second while the folder is being removed.
TWICE = """
import os, pathlib, shutil, signal, sys, time
mkdir, rmtree = pathlib.Path.mkdir, shutil.rmtree
def staged(self, *args, **kwargs):
    mkdir(self, *args, **kwargs)
    if ".nf4convert-partial-" in self.name:
        for _ in range(3):
            (self / f"part-{_}").write_bytes(b"x" * 1000)
        os.kill(os.getpid(), signal.SIGINT)
def slow(path, *args, **kwargs):
    if ".nf4convert-partial-" in str(path):
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, while the removal runs
        time.sleep(0.2)
        if sys.argv[1] == "cannot":
            return  # a folder that cannot be removed
    return rmtree(path, *args, **kwargs)
pathlib.Path.mkdir = staged
shutil.rmtree = slow
from nf4convert.cli.commands import main
main(sys.argv[2:])
"""


@pytest.mark.parametrize("removal", ["can", "cannot"])
def test_a_second_ctrl_c_while_the_folder_is_removed_does_not_stop_the_removal(tmp_path, removal):
    # 125-333 MB of staging were left while the message said "nothing was written"
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", TWICE, removal, str(EXAMPLE), "-o", str(out), "-q", "--device", "cpu"],
        env=package_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=default_stop_signals,
    )
    assert done.returncode == 130, done.stderr
    if removal == "can":
        assert done.stderr == "Error: interrupted; nothing was written\n" and not list(tmp_path.iterdir())
    else:
        (left,) = _staging_folders(tmp_path)
        assert done.stderr == (
            f"Error: interrupted; {left} is left (it could not be removed): remove it with: rm -rf {left}\n"
        )
        shutil.rmtree(left)
