"""Faults a user meets: unwritable outputs, signals while writing, batch collisions, verify's report.

Signals are sent to a real ``python -m nf4convert`` process, from inside its own tensor production (a
wrapper makes the third plain tensor raise the signal), so the real handler and cleanup run.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from nf4convert.cli.commands import main

from fixtures.cli import one_error_line
from fixtures.processes import default_stop_signals, package_env
from fixtures.staging_folders import killed_run_folder

pytest.importorskip("bitsandbytes")
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama-bnb-4bit"


def run(*args, code=0):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def test_names_with_newlines_still_give_one_line(tmp_path):
    odd = tmp_path / "two\nlines\rhere"
    line = one_error_line(run(odd, "-o", tmp_path / "out", code=1))
    assert "two\\nlines\\rhere" in line  # shown escaped
    odd.mkdir()
    (odd / "config.json").write_text("{}")
    line = one_error_line(run(odd, "-o", tmp_path / "out", code=1))
    assert "two\\nlines" in line
    line = one_error_line(run(EXAMPLE, "-o", tmp_path / "out\nput", "--device", "cu\nda", code=2))
    assert "cu\\nda" in line and not (tmp_path / "out\nput").exists()


def test_output_under_a_file_or_unwritable_place_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("user data")
    line = one_error_line(run(EXAMPLE, "-o", blocker / "out", "-q", code=1))
    assert str(blocker) in line and blocker.read_text() == "user data"
    # /proc takes no new folders, even from root (which file permissions would not stop).
    line = one_error_line(run(EXAMPLE, "-o", "/proc/nf4convert-test/out", "-q", code=1))
    # no space in the folder it would be made in (named: the free space is measured there), or it cannot be written
    assert line.startswith(("Error: /proc: 0.0 MB free, the output needs ", "Error: /proc: cannot be written")), line


@pytest.mark.parametrize("where", ["mkdir", "free-space"])
def test_read_only_file_system_is_one_line(tmp_path, monkeypatch, where):
    import errno

    from nf4convert.sinks import output

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    if where == "mkdir":
        monkeypatch.setattr(Path, "mkdir", read_only)
    else:
        monkeypatch.setattr(output.shutil, "disk_usage", read_only)
    line = one_error_line(run(EXAMPLE, "-o", tmp_path / "out", "-q", code=1))
    assert "Read-only file system" in line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("size", ["inf", "1e400", "-5GB", "nan"])
def test_absurd_shard_sizes_are_one_line(tmp_path, size):
    line = one_error_line(run(EXAMPLE, "-o", tmp_path / "out", "--max-shard-size", size, code=2))
    assert line.startswith(f"Error: --max-shard-size '{size}' ") and "max_shard_size" not in line  # the CLI's name


WRAPPER = """
import os, signal, sys
from nf4convert.kinds.copy import Copy
original, calls = Copy.produce, [0]
def producer(*args):
    calls[0] += 1
    if calls[0] == 3:  # to the whole process group (workers too, as a terminal's Ctrl-C) where it leads one
        (os.killpg if os.getpgrp() == os.getpid() else os.kill)(os.getpid(), getattr(signal, sys.argv[1]))
    yield from original(*args)
Copy.produce = producer
from nf4convert.cli.commands import main
main(sys.argv[2:])
"""


@pytest.mark.parametrize("processes", ["0", "2"])
@pytest.mark.parametrize(
    "signal_name,code,word",
    [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated"), ("SIGHUP", 129, "terminated")],
)
def test_signal_while_writing_leaves_nothing(tmp_path, signal_name, code, word, processes):
    out = tmp_path / "out"
    env = package_env(NF4CONVERT_PROCESSES=processes)
    result = subprocess.run(
        [sys.executable, "-c", WRAPPER, signal_name, str(EXAMPLE), "-o", str(out), "-q", "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        start_new_session=True,
        preexec_fn=default_stop_signals,
    )
    assert result.returncode == code, result.stderr
    assert one_error_line(result.stdout + result.stderr) == f"Error: {word}; nothing was written"
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no hidden partial folder either


KILLED_WORKER = """
import os, signal, sys
from nf4convert.kinds import dequantize_4bit
parent = os.getpid()
def killed(*args, **kwargs):
    if os.getpid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)
dequantize_4bit.dequantize_on_host = killed
from nf4convert.cli.commands import main
main(sys.argv[1:])
"""


def test_a_worker_process_killed_is_one_line_and_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    env = package_env(NF4CONVERT_PROCESSES="2")
    result = subprocess.run(
        [sys.executable, "-c", KILLED_WORKER, str(EXAMPLE), "-o", str(out), "-q", "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr
    line = one_error_line(result.stderr)
    assert "worker process of the CPU route stopped" in line and "NF4CONVERT_PROCESSES=0" in line
    assert list(tmp_path.iterdir()) == []


# The signal lands at a chosen moment: just after the staging folder is made, just after OUT is renamed into place,
# or inside a destructor (where Python cannot raise it: it is reported when the command returns).
MOMENT_WRAPPER = """
import os, pathlib, signal, sys
from nf4convert.sinks import output
sig = getattr(signal, sys.argv[1])
if sys.argv[2] == "staged":
    mkdir = pathlib.Path.mkdir
    def staged(self, *args, **kwargs):
        mkdir(self, *args, **kwargs)
        if ".nf4convert-partial-" in self.name:
            os.kill(os.getpid(), sig)
    pathlib.Path.mkdir = staged
elif sys.argv[2] == "verify":  # after OUT is complete, while --verify runs
    from nf4convert.verification import verify as verification
    check = verification.verified
    def verified(*args, **kwargs):
        os.kill(os.getpid(), sig)
        return check(*args, **kwargs)
    verification.verified = verified
elif sys.argv[2] == "in-place":
    move = output.move_into_place
    def moved(*args, **kwargs):
        move(*args, **kwargs)
        os.kill(os.getpid(), sig)
    output.move_into_place = moved
else:
    from nf4convert.kinds.copy import Copy
    original, calls = Copy.produce, [0]
    class Signals:
        def __del__(self):
            os.kill(os.getpid(), sig)
            sum(range(1000))  # the handler runs here, inside __del__
    def producer(*args):
        calls[0] += 1
        if calls[0] == 3:
            Signals()
        yield from original(*args)
    Copy.produce = producer
from nf4convert.cli.commands import main
main(sys.argv[3:])
"""


@pytest.mark.parametrize("moment", ["staged", "in-place", "destructor", "verify"])
@pytest.mark.parametrize("signal_name,code,word", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_a_signal_at_any_moment_says_what_was_written(tmp_path, moment, signal_name, code, word):
    out = tmp_path / "out"
    env = package_env()
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            MOMENT_WRAPPER,
            signal_name,
            moment,
            str(EXAMPLE),
            "-o",
            str(out),
            "-q",
            "--device",
            "cpu",
            *(["--verify"] if moment == "verify" else []),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        preexec_fn=default_stop_signals,
    )
    assert result.returncode == code, result.stderr
    line = one_error_line(result.stderr)
    if moment == "staged":  # the folder was just made: it goes
        assert line == f"Error: {word}; nothing was written" and list(tmp_path.iterdir()) == []
    else:  # OUT is complete: kept, and said so (no traceback from the destructor)
        assert line == f"Error: {word}; {out} was complete and is kept", line
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
        assert "OK: bit-exact" in run("verify", out, EXAMPLE, "-q", "--device", "cpu")


def test_a_signal_the_caller_ignores_stays_ignored(tmp_path):
    # nohup (SIGHUP) or trap '' INT: the run goes on and completes
    import signal

    out = tmp_path / "out"
    env = package_env()
    result = subprocess.run(
        [sys.executable, "-c", WRAPPER, "SIGHUP", str(EXAMPLE), "-o", str(out), "-q", "--device", "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    assert (out / "model.safetensors").exists()


def test_a_signal_deferred_out_of_an_import_is_not_sent_after_the_command(monkeypatch):
    # _on_signal sends a signal that landed inside an import again 50 ms later; once the command is over it must not
    # (the caller's own handlers are back by then: a test run, or the process, would be stopped by it)
    import signal

    from nf4convert.cli.signals import StopSignals

    sent = []
    monkeypatch.setattr(signal, "pthread_kill", lambda thread, signum: sent.append(signum))
    with StopSignals() as stops:
        stops._send_again(0, signal.SIGINT)
        stops.finish()
        stops._send_again(0, signal.SIGINT)
    assert sent == [signal.SIGINT]


def test_batch_signal_names_sources_not_attempted(tmp_path):
    second = tmp_path / "second-bnb-4bit"
    shutil.copytree(EXAMPLE, second)
    env = package_env()
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            WRAPPER,
            "SIGTERM",
            "batch",
            str(EXAMPLE),
            str(second),
            "-o",
            str(tmp_path / "root"),
            "-q",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        preexec_fn=default_stop_signals,
    )
    assert result.returncode == 143, result.stderr
    assert f"Error: terminated; not attempted: {second}" in result.stderr
    table = result.stdout.splitlines()
    assert table[1].split()[1] == "interrupted" and table[2].split()[1:3] == ["not", "attempted"]
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())


def test_batch_collisions_are_made_distinct_or_refused(tmp_path):
    first, second = tmp_path / "orgA" / "x-bnb-4bit", tmp_path / "orgB" / "X-bnb-4bit"
    shutil.copytree(EXAMPLE, first)
    shutil.copytree(EXAMPLE, second)
    root = tmp_path / "root"
    output = run("batch", first, second, "-o", root, "-q", "--overwrite")
    assert sorted(p.name for p in root.iterdir()) == ["orgA--x-bf16", "orgB--X-bf16"]
    for name in ("orgA--x-bf16", "orgB--X-bf16"):
        assert str(root / name) in output and (root / name / "model.safetensors").exists()
    # The same source twice: refused before anything is converted.
    shutil.rmtree(root)
    line = one_error_line(run("batch", first, str(first) + "/", "-o", root, "-q", code=2))
    assert "given twice" in line and not root.exists()


def test_batch_keeps_going_past_an_unwritable_output_and_prints_json(tmp_path):
    second = tmp_path / "second-bnb-4bit"
    shutil.copytree(EXAMPLE, second)
    root = tmp_path / "root"
    root.mkdir()
    (root / "tiny-llama-bf16").write_text("a file where the first output would go")
    result = CliRunner().invoke(main, ["batch", str(EXAMPLE), str(second), "-o", str(root), "-q", "--json"])
    assert result.exit_code == 1
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [row["status"] for row in rows] == ["failed", "ok"]
    assert "exists and is not a folder" in rows[0]["error"] and rows[1]["output"] == str(root / "second-bf16")
    assert rows[1]["tensors"] == 39 and rows[1]["bytes"] > 0 and rows[1]["seconds"] >= 0
    assert (root / "tiny-llama-bf16").read_text().startswith("a file")


def test_batch_dry_run_plans_each_source_and_writes_nothing(tmp_path):
    second = tmp_path / "second-bnb-4bit"
    shutil.copytree(EXAMPLE, second)
    broken = tmp_path / "broken-bnb-4bit"
    shutil.copytree(EXAMPLE, broken)
    shard = broken / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])  # truncated
    root = tmp_path / "root" / "deeper"
    result = CliRunner().invoke(
        main,
        [
            "batch",
            str(EXAMPLE),
            str(broken),
            str(second),
            "-o",
            str(root),
            "-q",
            "--json",
            "--dry-run",
            "--dtype",
            "fp16",
        ],
    )
    assert result.exit_code == 1, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]  # stdout: the rows only
    assert [row["status"] for row in rows] == ["planned", "failed", "planned"]
    assert [row["output"] for row in rows] == [
        str(root / name) for name in ("tiny-llama-fp16", "broken-fp16", "second-fp16")
    ]
    assert rows[0]["tensors"] == rows[2]["tensors"] == 39 and rows[0]["bytes"] == rows[2]["bytes"] > 0
    assert rows[1]["error"].startswith(f"{shard}: truncated"), rows[1]["error"]
    planned = 2 * rows[0]["bytes"]
    summary = [line for line in result.stderr.splitlines() if line.startswith("to write:")]
    assert (
        len(summary) == 1 and summary[0].startswith(f"to write: {planned / 1e9:.3f}") and "for 2 planned" in summary[0]
    ), summary
    assert "dry run: nothing was written" in result.stderr and not (tmp_path / "root").exists()

    table = CliRunner().invoke(main, ["batch", str(EXAMPLE), "-o", str(root), "-q", "--dry-run"])
    assert table.exit_code == 0 and "planned" in table.stdout and "dry run: nothing was written" in table.stdout, (
        table.output
    )
    assert not (tmp_path / "root").exists()


# --- verify's report ------------------------------------------------------------------------------------


def _edit_output_tensor(folder: Path, name: str, edit):
    """Rewrite the shard holding ``name`` after ``edit(header, data)``."""
    shard = folder / "model.safetensors"
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    data = bytearray(raw[8 + length :])
    edit(header, data)
    encoded = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(data))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "out"
    run(EXAMPLE, "-o", out, "-q", "--device", "cpu")
    return out


def test_verify_names_a_retyped_weight(converted, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    name = "model.layers.1.mlp.up_proj.weight"
    _edit_output_tensor(out, name, lambda header, data: header[name].update(dtype="F16"))
    output = run("verify", out, EXAMPLE, code=1)
    assert f"MISMATCH {name}: F16 " in output and "BF16" in output and "FAILED: 1 problem\n" in output


def test_verify_blames_the_source_for_a_plain_tensor(converted, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    name = "model.norm.weight"

    def flip(header, data):
        data[header[name]["data_offsets"][0] + 1] ^= 0x40

    _edit_output_tensor(out, name, flip)
    output = run("verify", out, EXAMPLE, code=1)
    assert (
        f"{name}: 1 of 256 elements differ from the source tensor" in output
        and "bitsandbytes" not in output.split("MISMATCH")[1]
    )


def test_verify_recognises_swapped_arguments(converted):
    line = one_error_line(run("verify", EXAMPLE, converted, code=2))
    assert "is a bitsandbytes checkpoint" in line and "the order is OUT, then SOURCE" in line


# --- CLI conventions ------------------------------------------------------------------------------------


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    out = tmp_path / "deeper" / "out"
    output = run(EXAMPLE, "-o", out, "--dry-run", "--dtype", "float16")
    assert f"output: {out} (float16)" in output and "tensors: 39 (11 copied, 28 dequantized from 4-bit)" in output
    assert "model.safetensors: 39 tensors" in output and "free where it goes" in output and "(enough)" in output
    assert "dry run: nothing was written" in output and not (tmp_path / "deeper").exists()


def test_conventions_help_typos_aliases_and_quiet_summary(tmp_path):
    env = package_env()
    bare = subprocess.run([sys.executable, "-m", "nf4convert"], capture_output=True, text=True, env=env, timeout=120)
    assert bare.returncode == 0 and "Usage: nf4convert" in bare.stdout and "verify" in bare.stdout
    typo = subprocess.run(
        [sys.executable, "-m", "nf4convert", "verfy", "a", "b"], capture_output=True, text=True, env=env, timeout=120
    )
    assert typo.returncode == 2 and one_error_line(typo.stdout + typo.stderr).startswith(
        "Error: no such command 'verfy'; did you mean verify?"
    )
    # A word that is no command and no folder is still taken as a SOURCE (and said to be missing).
    line = one_error_line(run("./no-such-model", "-q", code=1))
    assert "no such folder" in line
    # torch's dtype names work as the short ones do; -q keeps the one-line summary.
    output = run(EXAMPLE, "-o", tmp_path / "out", "--dtype", "bfloat16", "-q", "--device", "cpu")
    assert (
        output.strip().startswith(f"{tmp_path / 'out'}: 39 tensors (11 copied, 28 dequantized from 4-bit)")
        and "GB bfloat16" in output
    )
    assert len(output.strip().splitlines()) == 1


def test_runs_to_one_output_never_share_or_replace_each_other(tmp_path):
    from nf4convert.errors import OutputError
    from nf4convert.sinks import output

    out = tmp_path / "out"
    stale = killed_run_folder(tmp_path, ".out.nf4convert-partial")  # a run killed outright
    (stale / "model.safetensors").write_bytes(b"half")
    with pytest.raises(OutputError, match="appeared while converting"), output.staging(out) as mine:
        assert mine.name.startswith(f".out.nf4convert-partial-{os.getpid()}-") and not stale.exists()
        (mine / "model.safetensors").write_bytes(b"mine")
        out.mkdir()  # another run finished first
        (out / "model.safetensors").write_bytes(b"theirs")
        output.move_into_place(mine, out)
    assert (out / "model.safetensors").read_bytes() == b"theirs" and not list(tmp_path.glob(".*nf4convert*"))


@pytest.mark.parametrize("case", ["garbage", "missing", "wrong-dtype", "duplicate-key"])
def test_verify_checks_the_output_config(converted, tmp_path, case):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    config = out / "config.json"
    if case == "garbage":
        config.write_text("garbage")
    elif case == "missing":
        config.unlink()
    elif case == "wrong-dtype":
        config.write_text(config.read_text().replace('"bfloat16"', '"float16"'))
    else:
        config.write_text('{"a": 1, "a": 2}')
    output = run("verify", out, EXAMPLE, code=1)
    assert "MISMATCH config.json: " in output and "FAILED: 1 problem\n" in output


def _process(args, **kwargs):
    env = package_env()
    return subprocess.run([sys.executable, "-m", "nf4convert", *map(str, args)], env=env, timeout=300, **kwargs)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_or_closed_standard_stream_is_no_traceback(tmp_path):
    # stdout on a full device: the conversion is done, the summary cannot be printed: one line on stderr, exit 1
    with open("/dev/full", "w") as full:
        result = _process(
            [EXAMPLE, "-o", tmp_path / "full", "--device", "cpu", "-q"], stdout=full, stderr=subprocess.PIPE, text=True
        )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == "Error: cannot print to standard output (No space left on device)"
    assert "OK: bit-exact" in run("verify", tmp_path / "full", EXAMPLE, "-q", "--device", "cpu")
    # stdout closed: nothing to print to, the run succeeds; stderr closed: no progress bars, the run succeeds
    for fd, name in ((1, "no-stdout"), (2, "no-stderr")):
        result = _process(
            [EXAMPLE, "-o", tmp_path / name, "--device", "cpu"],
            preexec_fn=lambda fd=fd: os.close(fd),
            capture_output=fd == 1,
        )
        assert result.returncode == 0 and (tmp_path / name / "model.safetensors").exists()


def test_batch_from_a_file_that_is_not_text_is_one_line(tmp_path):
    listing = tmp_path / "models.txt"
    listing.write_bytes(b"org/a\n\xb2\xff\x00 binary")
    result = CliRunner().invoke(main, ["batch", "--from-file", str(listing), "-o", str(tmp_path / "root")])
    assert result.exit_code == 2 and "not UTF-8 text" in one_error_line(result.output) and str(listing) in result.output


def test_stale_partial_folders_of_other_names_are_left_alone(tmp_path, monkeypatch):
    # OUT 'x*' cleans only its own killed runs' folders, not those of 'xyz' or 'x-data' that the glob would match
    monkeypatch.chdir(tmp_path)
    others = [killed_run_folder(tmp_path, f".{name}.nf4convert-partial", 4000000) for name in ("xyz", "x-data")]
    own = killed_run_folder(tmp_path, ".x*.nf4convert-partial", 4000002)
    for folder in (*others, own):
        (folder / "file").write_text("precious")
    run(EXAMPLE, "-o", "x*", "-q", "--device", "cpu")
    assert all((folder / "file").exists() for folder in others) and not own.exists()


def test_an_output_name_at_the_file_systems_limit_is_written_and_replaced(tmp_path, monkeypatch):
    # OUT's staging and old-OUT names add ~30 bytes to OUT's: a 250-byte (multi-byte UTF-8) OUT name must still
    # work, a killed run's staging folder for it still be cleaned, and other long names' left alone
    monkeypatch.chdir(tmp_path)
    name = "é" * 120 + "-bf16" + "x" * 5  # 250 bytes
    sibling = "é" * 120 + "-bf16" + "y" * 5  # the same first bytes
    assert len(os.fsencode(name)) == 250
    from nf4convert.sinks import output

    stem = output._beside(Path(name), output.PARTIAL_SUFFIX, room=output.PID_ROOM)
    theirs = output._beside(Path(sibling), output.PARTIAL_SUFFIX, room=output.PID_ROOM)
    assert stem != theirs and len(os.fsencode(stem)) + output.PID_ROOM <= 255
    killed_run_folder(tmp_path, stem)  # killed outright (pids and the token fit in PID_ROOM)
    kept = killed_run_folder(tmp_path, theirs)
    run(EXAMPLE, "-o", name, "-q", "--device", "cpu")
    run(EXAMPLE, "-o", name, "-q", "--device", "cpu", "--overwrite")
    assert "OK: bit-exact" in run("verify", name, EXAMPLE, "-q", "--device", "cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, kept.name])


# --- ends of failed runs, folders made for OUT, batch's output root and listing ---------------------------------------

TEARDOWN_WRAPPER = """
import atexit, sys
atexit.register(lambda: print("interpreter teardown", file=sys.stderr))  # runs only if the interpreter unwinds
from nf4convert.cli.commands import main
main()
"""


def _truncated(tmp_path: Path) -> Path:
    source = tmp_path / "bad-bnb-4bit"
    shutil.copytree(EXAMPLE, source)
    shard = source / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    return source


@pytest.mark.parametrize("case", ["convert", "usage", "batch", "verify"])
def test_a_failed_run_ends_without_the_interpreters_teardown(tmp_path, converted, case):
    # A failed run leaves as a finished one does (console._exit_now): no ~0.5 s of torch's teardown in which a Ctrl-C
    # printed a traceback from torch's atexit callback; what it printed is flushed first and the exit code is kept.
    out = tmp_path / "out"
    if case == "convert":
        args, code = [_truncated(tmp_path), "-o", out], 1
    elif case == "usage":  # a bad option value found once torch is loaded
        args, code = [EXAMPLE, "-o", out, "--device", "tpu"], 2
    elif case == "batch":
        args, code = ["batch", _truncated(tmp_path), EXAMPLE, "-o", tmp_path / "root", "--device", "cpu"], 1
    else:
        shutil.copytree(converted, out)
        (out / "config.json").write_text("{}")
        args, code = ["verify", out, EXAMPLE, "--device", "cpu"], 1
    env = package_env()
    result = subprocess.run(
        [sys.executable, "-c", TEARDOWN_WRAPPER, *map(str, args), "-q"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == code, result.stderr
    assert "interpreter teardown" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    if case == "batch":  # the table, on a pipe (block-buffered), came through
        assert [line.split()[1] for line in result.stdout.splitlines()[1:]] == ["failed", "ok"], result.stdout
        assert result.stderr.strip().endswith("1 of 2 failed")
    elif case == "verify":
        assert "FAILED: 1 problem" in result.stdout
    else:
        assert one_error_line(result.stderr) and not out.exists()


def test_folders_made_for_an_interrupted_output_go_too(tmp_path):
    # -o out10/x interrupted while writing: out10, made for it, goes with the staging folder
    env = package_env()
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            WRAPPER,
            "SIGINT",
            str(EXAMPLE),
            "-o",
            str(tmp_path / "out10" / "x"),
            "-q",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 130, result.stderr
    assert one_error_line(result.stderr) == "Error: interrupted; nothing was written"
    assert list(tmp_path.iterdir()) == []


def test_folders_made_for_a_failed_output_go_and_the_users_stay(tmp_path, monkeypatch):
    from nf4convert.safetensors_io import write as writing

    def no_space(self, name, data, offset=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writing.ShardWriter, "write", no_space)
    (tmp_path / "mine").mkdir()  # the user's (empty) folder: only those this run made go
    line = one_error_line(
        run(EXAMPLE, "-o", tmp_path / "mine" / "new" / "deeper" / "out", "-q", "--device", "cpu", code=1)
    )
    assert "No space left on device" in line
    assert [p.name for p in tmp_path.iterdir()] == ["mine"] and not list((tmp_path / "mine").iterdir())
    # batch: every conversion failed, so its output root (made by this run) goes too
    second = tmp_path / "mine" / "second-bnb-4bit"
    shutil.copytree(EXAMPLE, second)
    result = CliRunner().invoke(
        main, ["batch", str(EXAMPLE), str(second), "-o", str(tmp_path / "root" / "deeper"), "-q", "--device", "cpu"]
    )
    assert result.exit_code == 1 and "2 of 2 failed" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


@pytest.mark.parametrize("root", ["a-bnb-4bit/out", "a-bnb-4bit", "a-bnb-4bit/deeper/out"])
def test_batch_refuses_an_output_root_in_a_source(tmp_path, monkeypatch, root):
    # b's output would land in a's folder: refused as a usage error before anything is converted
    monkeypatch.chdir(tmp_path)
    shutil.copytree(EXAMPLE, tmp_path / "a-bnb-4bit")
    shutil.copytree(EXAMPLE, tmp_path / "b-nf4")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    line = one_error_line(run("batch", "b-nf4", "a-bnb-4bit", "-o", root, "-q", "--device", "cpu", code=2))
    assert line.startswith(f"Error: -o {root}: is ") and "the source folder a-bnb-4bit" in line
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    # a root that holds the sources is fine: the outputs go beside them
    run("batch", "b-nf4", "a-bnb-4bit", "-o", ".", "-q", "--device", "cpu")
    assert (tmp_path / "a-bf16" / "model.safetensors").exists() and (tmp_path / "b-bf16" / "model.safetensors").exists()


def test_batch_rows_name_the_real_output_once_the_dtype_is_decided(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "tiny-llama-bf16").write_text("a file where the output would go")  # fails after the plan (dtype auto)
    bad = _truncated(tmp_path)  # fails in the plan: the dtype is not decided
    result = CliRunner().invoke(
        main,
        [
            "batch",
            str(EXAMPLE),
            str(bad),
            str(tmp_path / "missing"),
            "-o",
            str(root),
            "-q",
            "--json",
            "--device",
            "cpu",
        ],
    )
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [row["status"] for row in rows] == ["failed"] * 3
    assert [row["output"] for row in rows] == [
        str(root / "tiny-llama-bf16"),
        str(root / "bad-<dtype>"),
        str(root / "missing-<dtype>"),
    ]
    # --dtype given: every row names its folder, in the table too
    result = CliRunner().invoke(
        main,
        ["batch", str(bad), str(tmp_path / "missing"), "-o", str(root), "-q", "--dtype", "float16", "--device", "cpu"],
    )
    table = result.stdout.splitlines()
    assert [line.split()[2] for line in table[1:]] == [str(root / "bad-fp16"), str(root / "missing-fp16")], (
        result.stdout
    )


def test_batch_same_folder_under_two_spellings_is_given_twice(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(EXAMPLE, tmp_path / "d1" / "x-bnb-4bit")
    for second in (tmp_path / "d1" / "x-bnb-4bit", "./d1/x-bnb-4bit", "d1/../d1/x-bnb-4bit"):
        line = one_error_line(run("batch", "d1/x-bnb-4bit", second, "-o", "root", "-q", code=2))
        assert line == f"Error: {second}: given twice (as 'd1/x-bnb-4bit' too)"
    assert not (tmp_path / "root").exists()


def test_batch_from_file_comments_and_byte_order_mark(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(EXAMPLE, tmp_path / "a-bnb-4bit")
    shutil.copytree(EXAMPLE, tmp_path / "h#1" / "hash-bnb-4bit")
    listing = tmp_path / "models.txt"
    listing.write_bytes(
        "\ufeffa-bnb-4bit\nh#1/hash-bnb-4bit   # a comment after a space\n  # a whole-line comment\n\n".encode()
    )
    result = CliRunner().invoke(
        main, ["batch", "--from-file", str(listing), "-o", "root", "-q", "--json", "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(row["source"], row["output"], row["status"]) for row in rows] == [
        ("a-bnb-4bit", "root/a-bf16", "ok"),
        ("h#1/hash-bnb-4bit", "root/hash-bf16", "ok"),
    ]


@pytest.mark.parametrize("depth", [600, 100_000])
def test_a_config_nested_too_deeply_is_one_line(tmp_path, depth):
    # the plan refused it, then the refusal's rewording parsed it again with json.loads: a RecursionError traceback
    source = tmp_path / "deep-bnb-4bit"
    shutil.copytree(EXAMPLE, source)
    (source / "config.json").write_text("[" * depth + "]" * depth)
    line = one_error_line(run(source, "-o", tmp_path / "out", "-q", "--device", "cpu", code=1))
    assert line == f"Error: {source / 'config.json'}: not JSON that can be read (nested too deeply)"
    assert not (tmp_path / "out").exists()


def test_a_mistyped_relative_path_is_no_such_folder_not_a_hub_lookup(tmp_path, monkeypatch):
    # models/llama-bnb-4bit with a models/ folder here is a path mistyped, not a Hub repo to ask for
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a lookup would be "could not be reached"
    line = one_error_line(run("models/llama-bnb-4bit", "-q", "--dry-run", code=1))
    assert line == (
        "Error: models/llama-bnb-4bit: no such folder in models/ (a Hub repo id is not looked up while a folder "
        "models/ is here)"
    )
