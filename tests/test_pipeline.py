"""The streaming pipeline: pieces made on several threads, written at their planned offsets, byte for byte what the
reference libraries give; failures stop every stage; positional shard writes in any order."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nf4convert.dtypes import output_dtype
from nf4convert.kinds import dequantize_4bit
from nf4convert.pipeline import core as pipeline_core
from nf4convert.pipeline import piece as pieces
from nf4convert.pipeline.routes.cpu import CpuRoute
from nf4convert.plan import make_plan
from nf4convert.safetensors_io.read import TensorReader
from nf4convert.safetensors_io.write import ShardWriter
from nf4convert.settings import Settings
from nf4convert.sinks.safetensors import write_shards

from fixtures.processes import default_stop_signals
from fixtures.weights import bnb_reference_cpu, quantize

pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as F  # noqa: E402


def _checkpoint(folder, seed):
    """4-bit weights of odd shapes (nested and flat, NF4 and FP4, several blocksizes), an 8-bit weight, plain
    tensors that are cast (fp32, fp16) and kept (int64, bf16); returns it with the expected output per tensor."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    tensors, expected = {}, {}
    for index, (quant_type, blocksize, nested) in enumerate(
        [("nf4", 64, True), ("fp4", 128, False), ("nf4", 256, False), ("fp4", 64, True), ("nf4", 64, True)]
    ):
        shape = (rng.randrange(40, 130), rng.randrange(300, 900) | 1)
        packed, state = quantize(
            shape,
            quant_type=quant_type,
            blocksize=blocksize,
            nested=nested,
            dtype=torch.bfloat16,
            seed=rng.randrange(1 << 30),
        )
        name = f"layers.{index}.weight"
        tensors[name] = packed
        tensors.update({f"{name}.{k}": v for k, v in state.as_dict(packed=True).items()})
        expected[name] = bnb_reference_cpu(packed, state)
    rows, columns = rng.randrange(50, 90), rng.randrange(200, 400) | 1
    codes = torch.randint(-127, 128, (rows, columns), dtype=torch.int8, generator=generator)
    scb = torch.rand(rows, generator=generator) * 3 + 0.01
    tensors.update({"int8.weight": codes, "int8.SCB": scb, "int8.weight_format": torch.tensor(0, dtype=torch.uint8)})
    expected["int8.weight"] = F.int8_vectorwise_dequant(codes, scb).to(torch.bfloat16)
    plain = {
        "norm.weight": torch.randn(rng.randrange(700, 1500), generator=generator),
        "half.weight": torch.randn(rng.randrange(300, 700), 3, generator=generator).half(),
        "embed.weight": torch.randn(rng.randrange(900, 1300), 7, generator=generator).bfloat16(),
        "ids": torch.randint(0, 1 << 40, (rng.randrange(100, 300),), generator=generator),
    }
    tensors.update(plain)
    expected.update({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in plain.items()})
    folder.mkdir()
    names = sorted(tensors)
    shards = {"one.safetensors": names[::2], "two.safetensors": names[1::2]}  # a weight and its state apart
    for filename, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, folder / filename)
    weight_map = {k: filename for filename, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder, expected


class SmallPieces(CpuRoute):
    piece_bytes = 4096  # many pieces per weight: a few quant blocks (or one 8-bit row) each


def _convert(source, out, route, shard_size=10**9, settings=None):
    plan = make_plan(source, dtype=output_dtype("bf16"), max_shard_size=shard_size)
    out.mkdir()
    progress = []
    with TensorReader() as reader, route:
        write_shards(plan, out, reader, route, progress=progress.append, settings=settings)
    assert sum(progress) == plan.tensor_bytes
    return plan


def _files(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("seed", [1, 2])
def test_pieces_on_every_thread_give_the_reference_bytes(tmp_path, seed):
    source, expected = _checkpoint(tmp_path / "src", seed)
    threads = torch.get_num_threads()
    plan = _convert(source, tmp_path / "small", SmallPieces(workers=3, processes=0), shard_size=60_000)
    assert len(plan.shards) > 2 and torch.get_num_threads() == threads  # each maker's one thread is undone
    for shard in plan.shards:
        with safe_open(tmp_path / "small" / shard.filename, "pt") as file:
            for tensor in shard.tensors:
                got, want = file.get_tensor(tensor.name), expected[tensor.name]
                assert got.dtype == want.dtype and got.shape == want.shape, tensor.name
                want_bytes = want.contiguous().view(-1).view(torch.uint8)
                assert torch.equal(got.view(-1).view(torch.uint8), want_bytes), tensor.name
    # One maker with default pieces writes the very same files.
    _convert(source, tmp_path / "one", CpuRoute(workers=1, processes=0), shard_size=60_000)
    assert _files(tmp_path / "one") == _files(tmp_path / "small")


@pytest.mark.parametrize("route", [SmallPieces, CpuRoute])
def test_worker_processes_write_the_threads_bytes(tmp_path, route):
    source, _ = _checkpoint(tmp_path / "src", 5)
    _convert(source, tmp_path / "threads", route(workers=2, processes=0), shard_size=60_000)
    with route(processes=2) as in_processes:
        assert in_processes.makers == 2
        _convert(source, tmp_path / "processes", in_processes, shard_size=60_000)
        assert in_processes._workers._handed > 0  # pieces went through the shared slots
    assert _files(tmp_path / "processes") == _files(tmp_path / "threads")


def _pid_into(read, out, extra):
    out.view(np.int64)[0] = os.getpid()  # the pieces' bytes are numpy arrays
    out.view(np.int64)[1] = int(read.sum()) + extra.numel()


def _die(read, out):
    os._exit(3)


class _TwoArguments(Exception):
    def __init__(self, first, second):
        super().__init__(f"{first} {second}")


def _raise(read, out, kind):
    from nf4convert.errors import ArgumentError

    raise ArgumentError("bad piece", option="dtype") if kind == "ours" else _TwoArguments("cannot", "rebuild")


def test_an_exception_in_a_worker_is_raised_by_its_caller_and_the_worker_goes_on():
    from nf4convert.errors import ArgumentError
    from nf4convert.pipeline.routes.workers import Workers

    workers = Workers(1, 2, 64)
    read, out = workers.slot(16)[:16], workers.slot(16)[:16]
    try:
        with pytest.raises(ArgumentError, match="^bad piece$") as raised:
            workers.run(_raise, read, out, "ours")
        assert raised.value.option == "dtype"
        with pytest.raises(RuntimeError, match="^_TwoArguments: cannot rebuild$"):
            workers.run(_raise, read, out, "theirs")
        workers.run(_pid_into, read, out, torch.zeros(1))  # the one worker is still there
        assert out.view(np.int64)[0] != os.getpid()
    finally:
        workers.close()


def test_workers_end_with_a_parent_killed_outright(tmp_path):
    # SIGKILL runs no cleanup: the workers see their pipes close and go, and let go of the parent's stdout.
    import subprocess
    import time

    code = (
        "import os, signal; from nf4convert.pipeline.routes.cpu import CpuRoute; route = CpuRoute(processes=2); "
        "print(*[p.pid for p, _ in route._workers._all], flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)  # returns at EOF
    pids = [int(pid) for pid in result.stdout.split()]
    assert result.returncode == -9 and len(pids) == 2
    deadline = time.monotonic() + 30
    while (
        any(os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid) for pid in pids) and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid) for pid in pids)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


FORK_WINDOW = """
import os, signal, sys, threading, time
import torch
from nf4convert.pipeline.routes import workers
from nf4convert.kernels import cpu
def stop(signum, frame):  # as the CLI's handler does: an exception, which a child would print with a traceback
    raise KeyboardInterrupt
signal.signal(signal.SIGINT, stop)
serve = workers._serve
def slow_serve(*args):  # a worker that takes long to reach its first line: the window a signal could land in
    time.sleep(1.0)
    serve(*args)
workers._serve = slow_serve
threading.Timer(0.3, os.killpg, (os.getpgrp(), signal.SIGINT)).start()  # while the workers are still starting
try:
    made = workers.Workers(2, 2, 64)
    print("started", flush=True)
    time.sleep(2)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_a_stop_signal_while_the_workers_start_reaches_only_this_process():
    import subprocess

    result = subprocess.run(
        [sys.executable, "-c", FORK_WINDOW],
        capture_output=True,
        text=True,
        timeout=60,
        start_new_session=True,
        preexec_fn=default_stop_signals,
    )
    assert result.stdout.split() == ["started", "interrupted"] and "Traceback" not in result.stderr, result.stderr


def test_buffers_past_the_slots_come_from_the_private_pool_and_go_back_there():
    class Slots:
        def __init__(self):
            self.given = []

        def slot(self, nbytes):
            if nbytes > 8 or len(self.given) == 2:
                return None
            self.given.append(np.empty(8, dtype=np.uint8))
            return self.given[-1]

        def holds(self, buffer):
            return any(buffer.ctypes.data == given.ctypes.data for given in self.given)

    slots, private = Slots(), pieces.Buffers(16, pinned=False)
    shared = pieces.Buffers(16, False, slots, overflow=private)
    first, second, third, large = shared.take(8), shared.take(8), shared.take(8), shared.take(12)
    assert slots.holds(first) and slots.holds(second) and not slots.holds(third) and not slots.holds(large)
    for buffer in (first, second, third, large):
        shared.give(buffer)
    assert len(shared._free) == 2 and len(private._free) == 2


def test_workers_run_in_other_processes_only_for_shared_bytes():
    from nf4convert.pipeline.routes.workers import Workers

    workers = Workers(2, 3, 64)
    try:
        read, out = workers.slot(16), workers.slot(64)
        assert workers.slot(65) is None  # larger than a slot
        read[:16] = 1
        workers.run(_pid_into, read[:16], out[:16], torch.zeros(5, dtype=torch.bfloat16))
        pid, total = out[:16].view(np.int64).tolist()
        assert pid != os.getpid() and total == 16 + 5
        private = np.zeros(16, dtype=np.uint8)
        workers.run(_pid_into, read[:16], private, torch.zeros(2))  # not in the mapping: made here
        assert private.view(np.int64).tolist() == [os.getpid(), 18]
        assert workers.slot(8) is not None and workers.slot(8) is None  # three slots, each handed out once
    finally:
        workers.close()


def test_a_route_never_closed_still_lets_the_process_exit():
    # multiprocessing's exit handler sends the workers SIGTERM (which they ignore) and waits: they are closed first.
    import subprocess

    code = (
        "from nf4convert.pipeline.routes.cpu import CpuRoute; route = CpuRoute(processes=2); "
        "assert route._workers is not None"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_worker_that_dies_is_one_error():
    from nf4convert.errors import Nf4ConvertError
    from nf4convert.pipeline.routes.workers import Workers

    workers = Workers(1, 2, 64)
    read, out = workers.slot(8)[:8], workers.slot(8)[:8]
    try:
        with pytest.raises(Nf4ConvertError, match="worker process of the CPU route stopped"):
            workers.run(_die, read, out)
        # A later piece (another maker thread's) fails the same way at once, with no worker left to wait for.
        errors = []
        later = threading.Thread(
            target=lambda: errors.append(
                pytest.raises(Nf4ConvertError, workers.run, _pid_into, read, out, torch.zeros(1))
            )
        )
        later.start()
        later.join(timeout=30)
        assert not later.is_alive() and len(errors) == 1
    finally:
        workers.close()


@pytest.mark.parametrize("at_once", [2, 4, 16])
def test_shards_written_at_once_give_the_same_bytes(tmp_path, monkeypatch, at_once):
    source, _ = _checkpoint(tmp_path / "src", 8)
    plan = _convert(
        source,
        tmp_path / "one-by-one",
        SmallPieces(workers=2, processes=0),
        shard_size=60_000,
        settings=Settings(shards_at_once=1),
    )
    assert len(plan.shards) > 2
    _convert(
        source,
        tmp_path / "at-once",
        SmallPieces(workers=2, processes=0),
        shard_size=60_000,
        settings=Settings(shards_at_once=at_once),
    )
    assert _files(tmp_path / "at-once") == _files(tmp_path / "one-by-one")


def test_pieces_come_plain_tensors_first_and_shards_interleaved(tmp_path, monkeypatch):
    source, _ = _checkpoint(tmp_path / "src", 9)
    plan = make_plan(source, dtype=output_dtype("bf16"), max_shard_size=100_000)
    recipes = {tensor.name: type(tensor.recipe).__name__ for tensor in plan.tensors}
    # A shard whose plan puts a made tensor before a plain one: the order below must change that.
    contrary = [
        shard
        for shard in plan.shards
        if [recipes[t.name] for t in shard.tensors][:1] != ["Copy"]
        and "Copy" in [recipes[t.name] for t in shard.tensors]
    ]
    assert contrary and len(plan.shards) > 2
    pushed = []
    original = pipeline_core.Pipeline.push

    def push(self, writer, name, piece):
        pushed.append((writer.path.name, name))
        return original(self, writer, name, piece)

    monkeypatch.setattr(pipeline_core.Pipeline, "push", push)
    (tmp_path / "out").mkdir()
    with TensorReader() as reader, SmallPieces() as route:
        write_shards(
            plan,
            tmp_path / "out",
            reader,
            route,
            progress=lambda n: None,
            settings=Settings(shards_at_once=2),
        )
    for shard in plan.shards:  # within each shard, every plain tensor's pieces before any made tensor's
        kinds = [recipes[name] for file, name in pushed if file == shard.filename]
        assert kinds == sorted(kinds, key=lambda kind: kind != "Copy"), shard.filename
    files = [file for file, _ in pushed]
    first_two = {shard.filename for shard in plan.shards[:2]}
    assert set(files[:2]) == first_two and files.index(plan.shards[2].filename) > max(
        i for i, file in enumerate(files) if file in first_two
    )  # two shards side by side, then the next ones


class _Event:
    def __init__(self, done):
        self.done, self.waited = done, False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = True


def test_a_buffer_whose_copy_is_done_is_taken_before_one_still_copying():
    buffers = pieces.Buffers(64, pinned=False)
    busy, idle = torch.empty(64, dtype=torch.uint8), torch.empty(64, dtype=torch.uint8)
    busy_event, idle_event = _Event(False), _Event(True)
    buffers.give(busy, busy_event)
    buffers.give(idle, idle_event)
    assert buffers.take(64) is idle and not busy_event.waited
    assert buffers.take(64) is busy and busy_event.waited  # the last one left: waited for
    fresh = buffers.take(64)
    assert fresh is not busy and fresh is not idle  # none free: a new one


def test_a_new_profile_report_drops_what_a_failed_run_left(monkeypatch, capsys):
    from nf4convert import profile

    monkeypatch.setattr(profile, "process_age", iter([1.0, 2.0, 5.0, 6.0, 7.0]).__next__)
    profile.start("convert called", enabled=True)
    profile.mark("device picked")  # a run that fails here never reports
    profile.start("convert called", enabled=True)
    profile.mark("device picked")
    profile.mark("device picked")  # the first time a moment is reached counts
    profile.report()
    report = json.loads(capsys.readouterr().err)["profile"]
    assert report == {"marks": {"convert called": 5.0, "device picked": 6.0, "reported": 7.0}}


def test_profile_reports_where_the_time_went(tmp_path):
    import os
    import subprocess
    import sys

    source, _ = _checkpoint(tmp_path / "src", 10)
    env = {**os.environ, "NF4CONVERT_PROFILE": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nf4convert",
            str(source),
            "-o",
            str(tmp_path / "out"),
            "-q",
            "--device",
            "cpu",
            "--dtype",
            "bf16",
            "--allow-no-config",  # a checkpoint of tensors alone
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "tensors" in result.stdout  # the summary line survives the fast exit
    report = json.loads([line for line in result.stderr.splitlines() if line.startswith('{"profile"')][-1])["profile"]
    marks = report["marks"]
    assert list(marks) == [
        "convert called",
        "device picked",
        "planned",
        "first piece written",
        "tensors written",
        "in place",
        "reported",
    ]
    assert all(a <= b for a, b in zip(marks.values(), list(marks.values())[1:]))
    assert report["pipeline"]["pieces"] > 0 and set(report["pipeline"]["busy"]) == {"read", "make", "write"}


@pytest.mark.parametrize("processes", [0, 2])
def test_a_failing_piece_stops_every_stage(tmp_path, monkeypatch, processes):
    source, _ = _checkpoint(tmp_path / "src", 3)
    calls = {"n": 0}
    original = SmallPieces.make

    def failing(self, host, device=None):
        make = original(self, host, device)
        if host.func is not dequantize_4bit.dequantize_on_host:
            return make

        def make_or_fail(read, out):
            calls["n"] += 1
            if calls["n"] == 5:
                raise MemoryError("piece 5")
            return make(read, out)

        return make_or_fail

    monkeypatch.setattr(SmallPieces, "make", failing)
    descriptors = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    with pytest.raises(MemoryError, match="piece 5"):
        _convert(source, tmp_path / "out", SmallPieces(workers=2, processes=processes))
    assert not [t for t in threading.enumerate() if t.name.startswith("nf4convert-")]
    if descriptors is not None:  # every shard's file, the writeback's and the workers' own descriptors closed
        assert len(os.listdir("/proc/self/fd")) == descriptors


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc (Linux)")


def _recording_sync_file_range(monkeypatch, result=0, pause=0.0):
    """Replace libc's sync_file_range with a recorder: (path, position, length) of each call."""
    import time

    from nf4convert.safetensors_io import write as writing

    calls = []

    def record(descriptor, position, length, flags):  # on the writeback's thread: asserts go in the test
        calls.append((os.path.basename(os.readlink(f"/proc/self/fd/{descriptor}")), position, length, flags))
        time.sleep(pause)
        return result

    monkeypatch.setattr(writing, "_sync_file_range", lambda: record)
    return calls


@needs_proc
def test_writeback_is_asked_for_every_range_written(tmp_path, monkeypatch):
    from nf4convert.safetensors_io import write as writing

    source, _ = _checkpoint(tmp_path / "src", 10)
    calls = _recording_sync_file_range(monkeypatch)
    asked = []
    original = writing.Writeback.request

    def request(self, descriptor, position, length):
        asked.append((os.path.basename(os.readlink(f"/proc/self/fd/{descriptor}")), position, length))
        original(self, descriptor, position, length)

    monkeypatch.setattr(writing.Writeback, "request", request)
    descriptors = len(os.listdir("/proc/self/fd"))
    plan = _convert(source, tmp_path / "out", SmallPieces(workers=2), shard_size=60_000)
    assert len(os.listdir("/proc/self/fd")) == descriptors  # the writeback's own descriptors are closed
    assert not [t for t in threading.enumerate() if t.name == "nf4convert-writeback"]
    assert calls and all(flags == writing.Writeback.SYNC_FILE_RANGE_WRITE for *_, flags in calls)
    assert {call[:3] for call in calls} <= set(asked)  # the calls made are ranges asked for
    for shard in plan.shards:
        ranges = sorted((position, position + length) for name, position, length in asked if name == shard.filename)
        covered = 0
        for begin, end in ranges:  # every byte of the file asked for once, the header included
            assert begin == covered, shard.filename
            covered = end
        assert covered == (tmp_path / "out" / shard.filename).stat().st_size


def _closed(descriptor):
    try:
        os.fstat(descriptor)
    except OSError:
        return True
    return False


@needs_proc
def test_writeback_stops_at_its_first_failure_and_close_drops_the_queue(tmp_path, monkeypatch):
    import time

    from nf4convert.safetensors_io import write as writing

    path = tmp_path / "f"
    path.write_bytes(b"x" * 4096)
    calls = _recording_sync_file_range(monkeypatch, result=-1)
    with open(path, "rb") as file:
        writeback = writing.Writeback()
        own = writeback.open(file.fileno())
        for position in range(0, 4096, 1024):
            writeback.request(own, position, 1024)
        writeback.release(own)
        deadline = time.monotonic() + 10
        while not _closed(own) and time.monotonic() < deadline:
            time.sleep(0.01)
        writeback.close()
    assert _closed(own) and len(calls) == 1  # one failure, then no more calls

    calls = _recording_sync_file_range(monkeypatch, pause=0.05)  # a disk that keeps each call waiting
    with open(path, "rb") as file:
        writeback = writing.Writeback()
        own = writeback.open(file.fileno())
        for position in range(200):
            writeback.request(own, position, 1)
        writeback.release(own)
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:  # the thread is at work
            time.sleep(0.001)
        started = time.monotonic()
        writeback.close()
        assert time.monotonic() - started < 2  # 200 calls would take 10 s: the queue is dropped, not waited for
        made = len(calls)
        time.sleep(0.2)
        assert 1 <= made == len(calls) < 200 and _closed(own)
        assert writeback.open(file.fileno()) is None  # closed: it starts nothing more


@needs_proc
def test_writeback_off_or_failing_changes_no_byte(tmp_path, monkeypatch):
    source, _ = _checkpoint(tmp_path / "src", 11)
    _convert(source, tmp_path / "on", SmallPieces(workers=2), shard_size=60_000)
    _recording_sync_file_range(monkeypatch, result=-1)
    _convert(source, tmp_path / "failing", SmallPieces(workers=2), shard_size=60_000)
    calls = _recording_sync_file_range(monkeypatch)
    _convert(source, tmp_path / "off", SmallPieces(workers=2), shard_size=60_000, settings=Settings(writeback=False))
    assert not calls
    assert _files(tmp_path / "on") == _files(tmp_path / "failing") == _files(tmp_path / "off")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's call")
def test_sync_file_range_is_found_and_queues_a_range(tmp_path):
    from nf4convert.safetensors_io import write as writing

    call = writing._sync_file_range()
    assert call is not None
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10_000)
    with open(path, "rb+") as file:
        assert call(file.fileno(), 0, 10_000, writing.Writeback.SYNC_FILE_RANGE_WRITE) == 0
        assert call(-1, 0, 1, writing.Writeback.SYNC_FILE_RANGE_WRITE) == -1  # a bad descriptor fails, no raise


@needs_proc
def test_a_shard_writer_that_fails_to_start_closes_what_it_opened(tmp_path, monkeypatch):
    from nf4convert.safetensors_io import write as writing

    source, _ = _checkpoint(tmp_path / "src", 12)
    tensors = make_plan(source, dtype=output_dtype("bf16")).shards[0].tensors
    _recording_sync_file_range(monkeypatch)
    writeback = writing.Writeback()
    descriptors = len(os.listdir("/proc/self/fd"))

    def full_disk(self, view, position):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ShardWriter, "_pwrite", full_disk)
    with pytest.raises(OSError, match="No space"):
        ShardWriter(tmp_path / "x.safetensors", tensors, writeback)
    writeback.close()
    assert len(os.listdir("/proc/self/fd")) == descriptors  # the file's and the writeback's descriptors


def test_positional_writes_in_any_order(tmp_path):
    source, _ = _checkpoint(tmp_path / "src", 4)
    plan = make_plan(source, dtype=output_dtype("bf16"))
    rng = random.Random(5)
    generator = torch.Generator().manual_seed(6)
    writer = ShardWriter(tmp_path / "x.safetensors", plan.shards[0].tensors)
    written, pieces = {}, []
    for tensor in plan.shards[0].tensors:
        written[tensor.name] = data = torch.randint(0, 256, (tensor.nbytes,), dtype=torch.uint8, generator=generator)
        cuts = sorted({0, tensor.nbytes, *(rng.randrange(tensor.nbytes) for _ in range(3))})
        pieces += [(tensor.name, data[a:b], a) for a, b in zip(cuts, cuts[1:])]
    rng.shuffle(pieces)
    for name, data, offset in pieces:
        writer.write(name, data, offset=offset)
    with pytest.raises(RuntimeError, match="planned"):
        writer.write(pieces[0][0], torch.ones(1 << 30 >> 10, dtype=torch.uint8), offset=len(written[pieces[0][0]]) - 1)
    writer.close()
    with safe_open(tmp_path / "x.safetensors", "pt") as file:
        for name, data in written.items():
            assert torch.equal(file.get_tensor(name).contiguous().view(-1).view(torch.uint8), data), name
    short = ShardWriter(tmp_path / "y.safetensors", plan.shards[0].tensors)
    short.write(pieces[0][0], pieces[0][1], offset=pieces[0][2])
    with pytest.raises(RuntimeError, match="tensors unwritten"):
        short.close()


@pytest.mark.gpu
@pytest.mark.parametrize("piece_bytes", [512, 1 << 20])  # 512: every piece outgrows its slot
def test_cuda_route_writes_the_cpu_route_bytes(tmp_path, piece_bytes):
    source, _ = _checkpoint(tmp_path / "src", 7)
    _convert(source, tmp_path / "cpu", CpuRoute(), shard_size=60_000)

    from nf4convert.pipeline.routes.cuda import CudaRoute

    class Route(CudaRoute):
        pass

    Route.piece_bytes = piece_bytes
    plan = make_plan(source, dtype=output_dtype("bf16"), max_shard_size=60_000)
    (tmp_path / "cuda").mkdir()
    with TensorReader() as reader, Route(torch.device("cuda")) as route:
        write_shards(
            plan,
            tmp_path / "cuda",
            reader,
            route,
            progress=lambda n: None,
        )
    assert _files(tmp_path / "cuda") == _files(tmp_path / "cpu")


@pytest.mark.gpu
def test_a_tensor_made_on_the_gpu_leaves_it_a_piece_at_a_time_through_the_pinned_buffers():
    # a merged weight: host memory holds the pieces being copied out, never the weight
    from nf4convert.pipeline.routes.cuda import CudaRoute
    from nf4convert.safetensors_io.read import TensorInfo

    with CudaRoute(torch.device("cuda")) as route:
        size = 3 * route.piece_bytes + 1000
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
        expected = data.cpu()
        info = TensorInfo("w", "U8", (size,), 0, 0, Path("unused"))
        made = list(route.pieces_of(data ^ 0, info))  # cut while the work making it may still be queued
        step = route.piece_bytes
        assert [(p.offset, p.nbytes) for p in made] == [(0, step), (step, step), (2 * step, step), (3 * step, 1000)]
        assert all(p.on_device and p.count == 0 for p in made)
        nothing = torch.empty(0, dtype=torch.uint8)
        host = torch.empty(size, dtype=torch.uint8)
        for piece in made:
            buffer = route.pool(piece).take(piece.nbytes)
            assert buffer.is_pinned() and buffer.numel() == route.piece_bytes
            piece.make(nothing, buffer[: piece.nbytes]).synchronize()
            host[piece.offset : piece.offset + piece.nbytes] = buffer[: piece.nbytes]
            route.pool(piece).give(buffer)
        assert torch.equal(host, expected)
        # made whole again, on the GPU or in host memory (what a transpose or a GGUF sink asks for)
        for target in (torch.zeros(size, dtype=torch.uint8, device="cuda"), torch.zeros(size, dtype=torch.uint8)):
            for piece in made:
                route.make_into(piece, nothing, target[piece.offset : piece.offset + piece.nbytes])
            assert torch.equal(target.cpu(), expected)
        in_memory = list(route.pieces_of(expected, info))  # a tensor in host memory is handed over as it is
        assert not any(piece.on_device for piece in in_memory)


@pytest.mark.parametrize(
    "env,writeback,makers,processes",
    [
        ({}, True, 8, None),
        ({"NF4CONVERT_WRITEBACK": "Off", "NF4CONVERT_MAKERS": "3"}, False, 3, None),
        ({"NF4CONVERT_WRITEBACK": " no ", "NF4CONVERT_MAKERS": "", "NF4CONVERT_PROCESSES": "0"}, False, 8, 0),
        ({"NF4CONVERT_WRITEBACK": "1", "NF4CONVERT_PROCESSES": " 2"}, True, 8, 2),
    ],
)
def test_environment_knobs(env, writeback, makers, processes):
    import subprocess

    clean = {k: v for k, v in os.environ.items() if not k.startswith("NF4CONVERT_")}
    code = (
        "from nf4convert.settings import Settings; s = Settings.from_env(); print(s.writeback, s.makers, s.processes)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == [str(writeback), str(makers), str(processes)]


@pytest.mark.parametrize(
    "name, value",
    [
        ("NF4CONVERT_PROCESSES", "abc"),
        ("NF4CONVERT_PROCESSES", "-1"),
        ("NF4CONVERT_PROCESSES", "1.5"),
        ("NF4CONVERT_MAKERS", "0"),
        ("NF4CONVERT_WRITERS", "-3"),
        ("NF4CONVERT_SHARDS_AT_ONCE", "x"),
        ("NF4CONVERT_WRITEBACK", "maybe"),
        ("NF4CONVERT_PROFILE", "2"),
        ("NF4CONVERT_FAST_LAUNCH", "fast"),
    ],
)
@pytest.mark.parametrize("command", ["convert", "dry run", "batch"])
def test_a_bad_knob_is_one_line_naming_it(name, value, command, tmp_path):
    # bad values were ignored without a word; then a dry run let them pass, and a batch failed every source with them
    import subprocess

    from nf4convert.settings import VARIABLES, Settings

    example = str(Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit")
    arguments = {
        "convert": [example, "-o", str(tmp_path / "out"), "-q"],
        "dry run": [example, "-o", str(tmp_path / "out"), "--dry-run"],
        "batch": ["batch", example, str(tmp_path / "src2"), "-o", str(tmp_path / "out"), "-q"],
    }[command]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NF4CONVERT_")}
    result = subprocess.run(
        [sys.executable, "-m", "nf4convert", *arguments],
        env={**clean, name: value},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert name in VARIABLES
    switch = isinstance(getattr(Settings(), name.removeprefix("NF4CONVERT_").lower()), bool)
    assert result.returncode == 2 and result.stderr.strip() == f"Error: {name}={value!r}: " + (
        "not 1/on/true/yes or 0/off/false/no"
        if switch
        else f"not a whole number of {0 if name.endswith('PROCESSES') else 1} or more"
    ), result.stderr
    assert result.stdout == "" and not (tmp_path / "out").exists()


def test_processes_asked_for_are_at_most_one_per_core(monkeypatch):
    from nf4convert import devices
    from nf4convert.pipeline.routes import workers

    if not workers.usable():
        pytest.skip("worker processes are Linux only")
    monkeypatch.setattr(devices, "cpu_cores", lambda: 2)
    with CpuRoute(Settings(processes=3)) as route:  # a small excess: a lost cap fails here, not in 1000 forks
        assert route._workers is not None and route.makers == 2


def _cgroups(tmp_path, own: str, files: dict) -> tuple[str, str]:
    """A fake cgroup tree under tmp_path (``files``: relative path -> text) and a /proc/self/cgroup of ``own``."""
    for relative, text in files.items():
        (tmp_path / "fs" / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / relative).write_text(text)
    (tmp_path / "own").write_text(own)
    return str(tmp_path / "fs"), str(tmp_path / "own")


@pytest.mark.parametrize(
    "own, files, cap",
    [
        ("0::/\n", {"cpu.max": "150000 100000\n"}, 2),  # 1.5 cores count 2
        ("0::/\n", {"cpu.max": "max 100000\n"}, None),
        ("0::/a/b\n", {"a/b/cpu.max": "max 100000\n", "a/cpu.max": "100000 100000\n", "cpu.max": "300000 100000"}, 1),
        ("0::/a\n", {"a/cpu.max": "garbage\n"}, None),
        ("0::/a\n", {"a/cpu.max": "0 100000\n"}, None),
        (
            "4:memory:/x\n1:cpu,cpuacct:/docker/abc\n",
            {"cpu,cpuacct/cpu.cfs_quota_us": "250000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
            3,
        ),  # a container's own root
        (
            "1:cpu:/k/pod\n",
            {
                "cpu/k/pod/cpu.cfs_quota_us": "-1\n",
                "cpu/k/pod/cpu.cfs_period_us": "100000\n",
                "cpu/k/cpu.cfs_quota_us": "100000\n",
                "cpu/k/cpu.cfs_period_us": "50000\n",
            },
            2,
        ),
        ("1:cpuacct:/\n", {"cpuacct/cpu.cfs_quota_us": "100000\n", "cpuacct/cpu.cfs_period_us": "100000\n"}, None),
    ],
)
def test_cpu_cores_count_a_containers_quota(tmp_path, monkeypatch, own, files, cap):
    from nf4convert.devices import cpu_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)  # a large machine
    root, own_file = _cgroups(tmp_path, own, files)
    assert cpu_cores(root, own_file) == (cap or 64)
    assert cpu_cores(root, str(tmp_path / "missing")) == 64
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5}, raising=False)  # pinned to one core: never more
    assert cpu_cores(root, own_file) == 1


def test_the_cpu_route_sizes_itself_by_the_cores_it_may_keep_busy(monkeypatch):
    from nf4convert import devices
    from nf4convert.pipeline.routes import workers

    monkeypatch.setattr(devices, "cpu_cores", lambda: 3)  # under PROCESS_MIN_CORES: threads, one per core
    with CpuRoute() as route:
        assert route._workers is None and route.makers == 3
    if not workers.usable():
        return
    monkeypatch.setattr(devices, "cpu_cores", lambda: 9)  # one process per two cores
    with CpuRoute() as route:
        assert route._workers is not None and route.makers == 4


def test_holds_inf_sees_inf_behind_its_extremes():
    # the writers' ±inf check looks at a piece's extremes first; a NaN there must not hide an inf
    values = np.zeros(1000, dtype=np.float16)
    assert not pipeline_core.holds_inf(values.view(np.uint8))
    for extra in ([float("inf")], [float("-inf")], [float("nan"), float("inf")]):
        changed = values.copy()
        changed[: len(extra)] = extra
        assert pipeline_core.holds_inf(changed.view(np.uint8))
    changed = values.copy()
    changed[3] = float("nan")
    assert not pipeline_core.holds_inf(changed.view(np.uint8))
    assert not pipeline_core.holds_inf(np.full(9, 65504.0, dtype=np.float16).view(np.uint8))
    assert not pipeline_core.holds_inf(np.zeros(0, dtype=np.uint8))


@pytest.mark.parametrize("planning_imports_torch", [False, True])
def test_workers_forked_without_torch_are_forked_again_when_the_plan_needs_it(planning_imports_torch):
    # Each worker would import torch on its own (gigabytes of memory with eight workers): once the plan needs torch,
    # it is imported here and the workers forked again, sharing its pages, on one torch thread; also where planning
    # imported torch after the workers were forked (an FP8 scale's check)
    import subprocess

    code = """if True:
        import sys, types
        import numpy as np
        from nf4convert.pipeline.routes.cpu import CpuRoute
        def threads_into(read, out):
            out.view(np.int64)[0] = sys.modules["torch"].get_num_threads()
        route = CpuRoute(processes=2)
        before = [p.pid for p, _ in route._workers._all]
        assert sys.modules.get("torch") is None
        if PLANNING_IMPORTS_TORCH:
            import torch
        bf16 = types.SimpleNamespace(recipe=types.SimpleNamespace(numpy_made=False), dtype="BF16")  # torch's work
        route.warm(types.SimpleNamespace(tensors=[bf16]), None)
        after = [p.pid for p, _ in route._workers._all]
        import torch
        assert set(before).isdisjoint(after) and len(after) == 2 and route.makers == 2, (before, after)
        read, out = route._workers.slot(8)[:8], route._workers.slot(8)[:8]
        route._workers.run(threads_into, read, out)
        print(out.view(np.int64)[0], torch.get_num_threads())  # the workers', and this thread's (it merges)
        route.__exit__(None, None, None)
    """
    code = code.replace("PLANNING_IMPORTS_TORCH", str(planning_imports_torch))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    import torch

    assert result.stdout.split() == ["1", str(torch.get_num_threads())], result.stdout


def test_makers_run_torch_on_one_thread_wherever_it_is_imported(tmp_path, monkeypatch):
    # With torch imported already (an API caller), casts take torch's own cast (cpu.cast): one torch thread per maker,
    # not torch's default in each (the makers are the parallelism), and the caller's count back afterwards
    import nf4convert
    from nf4convert.kernels import cpu

    seen = set()
    cast = cpu.cast

    def spy(*args):
        seen.add((threading.current_thread().name.split("_")[0], torch.get_num_threads()))
        return cast(*args)

    monkeypatch.setattr(cpu, "cast", spy)
    monkeypatch.setenv("NF4CONVERT_PROCESSES", "0")
    threads = torch.get_num_threads()
    example = Path(__file__).resolve().parents[1] / "examples" / "tiny-llama-bnb-4bit"
    nf4convert.convert(str(example), str(tmp_path / "out"), dtype="fp32", device="cpu", progress=False)
    assert seen == {("nf4convert-make", 1)} and torch.get_num_threads() == threads
