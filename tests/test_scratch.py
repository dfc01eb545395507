"""Scratch folders in TMPDIR (the GGUF wing's staged folder, verify's expected file): removed when the run ends, and
a killed run's removed by the next run, while a live run's is never touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

from nf4convert.sinks.scratch import scratch_folder

HOLDER = textwrap.dedent(
    """
    import sys, tempfile, time
    tempfile.tempdir = sys.argv[1]
    from nf4convert.sinks.scratch import scratch_folder
    with scratch_folder("gguf") as folder:
        (folder / "half-written.gguf").write_bytes(b"x" * 1000)
        print(folder, flush=True)
        time.sleep(60)
    """
)


@pytest.fixture
def tmpdir_root(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _holder(root):
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE, text=True)
    folder = process.stdout.readline().strip()
    assert folder and os.path.isdir(folder)
    return process, folder


def test_a_scratch_folder_is_gone_after_its_block(tmpdir_root):
    with scratch_folder("gguf") as folder:
        (folder / "file").write_bytes(b"1")
        assert folder.parent == tmpdir_root and folder.name.startswith(f"nf4convert-gguf-{os.getpid()}-")
    assert not folder.exists() and list(tmpdir_root.iterdir()) == []


def test_a_killed_runs_scratch_folder_is_removed_by_the_next_run_and_a_live_ones_kept(tmpdir_root):
    killed, killed_folder = _holder(tmpdir_root)
    live, live_folder = _holder(tmpdir_root)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        with scratch_folder("gguf") as mine:
            assert not os.path.exists(killed_folder)  # its owner is provably gone: its lock is free
            assert os.path.isdir(live_folder)  # held: another run's, alive
        assert not mine.exists()
        with scratch_folder("verify"):  # another kind's scratch leaves gguf's alone
            assert os.path.isdir(live_folder)
    finally:
        live.kill()
        live.wait(10)
    unowned = tmpdir_root / "nf4convert-gguf-notapid-x"
    unowned.mkdir()
    with scratch_folder("gguf"):
        assert unowned.is_dir()  # a name that is not ours is never removed


def test_the_command_lines_handlers_probe_tmpdir_once_with_stop_signals_held(tmp_path):
    # tempfile's first use writes and removes a probe file: a stop signal between the two would leave it behind,
    # so the command line makes that probe itself, signals held, before any run can be stopped
    code = textwrap.dedent(
        """
        import tempfile
        from nf4convert.cli.signals import StopSignals
        assert tempfile.tempdir is None
        with StopSignals():
            print(tempfile.tempdir)
        """
    )
    env = dict(os.environ, TMPDIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path) and list(tmp_path.iterdir()) == []
