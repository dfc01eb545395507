"""hub/stream/ against the fake Hub (tests/fixtures/fake_hub.py): a repo's files read by ranges at one commit, the
bytes equal to the files' for any reads from any threads, every fault survived or reported in one line with its
tries, a flipped byte caught, a commit pushed mid-run ignored, the blocks held within the budget, the Hub cache's
blobs checked as they are read."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import threading
import time

import pytest

from nf4convert.errors import FetchError, IntegrityError, SourceNotFoundError
from nf4convert.hub import stream as stream_module
from nf4convert.hub.stream import Expected, RemoteFiles, StreamSettings, expected_of_cached

from fixtures.fake_hub import READ_TOKEN, Fault, serve

REPO, XET_REPO = "org/model-bnb-4bit", "org/xet-model-bnb-4bit"
KIB = 1 << 10
# small blocks and budget, so that a few MB cross many blocks, streams and evictions; quick retries
SETTINGS = StreamSettings(
    block_bytes=256 * KIB, memory_bytes=2 << 20, ahead_blocks=4, tries=4, wait_first=0.01, wait_most=0.05, timeout=1.0
)


@pytest.fixture(scope="module")
def hub():
    rng = random.Random(20240611)
    files = {
        "model-00001-of-00002.safetensors": rng.randbytes(5_000_003),
        "model-00002-of-00002.safetensors": rng.randbytes(1_234_567),
        "config.json": b'{"model_type": "llama"}',  # kept in git: checked by its blob id
    }
    with serve(lifetime=600) as (endpoint, state):
        commit = state.publish(REPO, files)
        yield endpoint, state, commit, files


@pytest.fixture
def faults(hub):
    """The fake Hub's fault list, empty before and after the test."""
    _, state, _, _ = hub
    state.faults.clear()
    yield state.faults
    state.faults.clear()


@pytest.fixture
def held(monkeypatch) -> list[int]:
    """The bytes of blocks held each time a block is taken on, as the test runs."""
    sizes = []
    new_block = RemoteFiles._new_block

    def watched(self, file, index):
        block = new_block(self, file, index)
        sizes.append(self._held)
        return block

    monkeypatch.setattr(RemoteFiles, "_new_block", watched)
    return sizes


def opened(hub, names=None, settings=SETTINGS, repo=REPO, commit=None, transport=None, **options) -> RemoteFiles:
    endpoint, _, first_commit, files = hub
    if transport is not None:
        settings = dataclasses.replace(settings, transport=transport)
    return RemoteFiles.open(
        repo,
        commit or first_commit,
        names or [name for name in files if name.endswith(".safetensors")],
        token=READ_TOKEN,
        endpoint=endpoint,
        settings=settings,
        **options,
    )


def read_all(file, piece: int, threads: int = 3, start: int = 0) -> bytearray:
    """The file read front to back in pieces of ``piece`` bytes by ``threads`` threads, as the pipeline reads."""
    out = bytearray(file.size)
    offsets = list(range(start, file.size, piece))
    lock = threading.Lock()
    errors = []

    def reader():
        while True:
            with lock:
                if not offsets or errors:
                    return
                offset = offsets.pop(0)
            try:
                file.pread(offset, memoryview(out)[offset : min(offset + piece, file.size)])
            except Exception as error:  # noqa: BLE001  (raised again below, in the test's thread)
                errors.append(error)

    workers = [threading.Thread(target=reader) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return out


# "auto": storage links read with http.client; "httpx": with huggingface_hub's client (as where a proxy is set)
TRANSPORTS = pytest.mark.parametrize("transport", ["auto", "httpx"])


@TRANSPORTS
def test_random_reads_from_several_threads_get_the_files_bytes(hub, transport):
    _, _, _, files = hub
    rng = random.Random(7)
    with opened(hub, names=list(files), transport=transport) as remote:
        assert remote["config.json"].info.expected.kind == "git-sha1"
        assert remote["model-00001-of-00002.safetensors"].info.expected == Expected(
            "sha256", hashlib.sha256(files["model-00001-of-00002.safetensors"]).hexdigest()
        )
        wrong = []

        def reader(seed):
            rng = random.Random(seed)
            for _ in range(40):
                name = rng.choice(list(files))
                data = files[name]
                first = rng.randrange(len(data))
                count = rng.choice([1, 7, rng.randrange(1, 70_000), rng.randrange(1, 900_000)])
                count = min(count, len(data) - first)
                out = bytearray(count)
                remote[name].pread(first, out)
                if out != data[first : first + count]:
                    wrong.append((name, first, count))

        workers = [threading.Thread(target=reader, args=(rng.random(),)) for _ in range(4)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert not wrong
        remote.finish()  # every file read is hashed, its bytes no read asked for fetched for the hash alone
        assert all(file.verified for file in remote.files.values())
        assert remote.stats.fetched >= sum(len(data) for data in files.values())


@pytest.mark.parametrize("threads,piece", [(1, 100_003), (3, 64 * KIB + 5), (3, 700_001)])
def test_front_to_back_reads_are_prefetched_once_within_the_budget(hub, threads, piece, held):
    _, state, _, files = hub
    name = "model-00001-of-00002.safetensors"
    before = len(state.downloads)
    with opened(hub, names=[name]) as remote:
        file = remote[name]
        header = bytearray(8 + 3000)
        file.pread(0, memoryview(header)[:8])  # a header, read apart
        file.pread(8, memoryview(header)[8:])
        out = read_all(file, piece, threads, start=len(header))
        out[: len(header)] = header
        assert out == files[name]
        remote.finish()
        assert file.verified
        # prefetched in blocks, each fetched once but the pages read before the stream proved itself (less than half
        # a block, and the header's), never past the budget by more than a block or two per reading thread (a read
        # that cannot wait fetches its blocks itself)
        assert remote.stats.fetched_again <= SETTINGS.block_bytes // 2 + 2 * stream_module.PAGE_BYTES, remote.stats
        blocks_per_read = -(-piece // SETTINGS.block_bytes) + 1
        assert max(held) <= SETTINGS.memory_bytes + (threads * blocks_per_read + 1) * SETTINGS.block_bytes, max(held)
        assert remote._held == 0
        ranges = state.downloads[before:]
        assert sum(end - first for _, first, end in ranges) == remote.stats.fetched


def read_interleaved(file, data) -> bytearray:
    """The file read as four output shards written at once read it: four places, a piece of each in turn."""
    quarter = len(data) // 4
    cursors = [k * quarter for k in range(4)]
    out = bytearray(len(data))
    piece = 100_000
    while any(cursor < min((k + 1) * quarter, len(data)) for k, cursor in enumerate(cursors)):
        for k in range(4):
            end = len(data) if k == 3 else (k + 1) * quarter
            if cursors[k] < end:
                count = min(piece, end - cursors[k])
                file.pread(cursors[k], memoryview(out)[cursors[k] : cursors[k] + count])
                cursors[k] += count
    return out


@pytest.mark.parametrize("flip", [False, True], ids=["clean", "flip-in-the-copy-fetched-again"])
def test_interleaved_streams_are_each_prefetched_and_held_blocks_stay_within_the_budget(hub, faults, flip, held):
    """Output shards written at once read one source file at several places: each is a stream, and what was read
    but waits for the hash beyond the budget is let go and fetched again for it, then compared with what was read."""
    _, _, _, files = hub
    name = "model-00001-of-00002.safetensors"
    data = files[name]
    if flip:  # in the last stream's first blocks, which the budget lets go of first: their second copy flipped
        faults.append(Fault("flip", file=name, offset=len(data) * 3 // 4 + 1000, after=1))
    with opened(hub, names=[name]) as remote:
        file = remote[name]
        if flip:  # caught when the copy fetched again comes (for a read, or for the hash), before anything is kept
            with pytest.raises(IntegrityError, match="came back different when read again"):
                read_interleaved(file, data)
                remote.finish()
            assert faults[0].hits == 1
            return
        assert read_interleaved(file, data) == data
        remote.finish()
        assert file.verified and remote._held == 0
        assert max(held) <= SETTINGS.memory_bytes + 3 * SETTINGS.block_bytes, max(held)
        assert 0 < remote.stats.fetched_again < len(data)  # the budget held less than the streams' spread


@pytest.mark.parametrize(
    "fault",
    [
        Fault("drop", at=0.4),
        Fault("status", status=500),
        Fault("status", status=503, times=2),
        Fault("status", status=429, retry_after="1"),
        Fault("stall", at=0.3, stall=3.0),
        Fault("truncate", at=0.5),
        Fault("expire"),
    ],
    ids=["dropped", "500", "503-twice", "429-retry-after", "stalled", "truncated", "expired-link"],
)
@TRANSPORTS
def test_each_fault_is_survived(hub, faults, fault, transport):
    _, state, _, files = hub
    name = "model-00002-of-00002.safetensors"
    fault = dataclasses.replace(fault, file=name, offset=600_000)  # a fresh one for each case
    faults.append(fault)
    before = len(state.downloads)
    started = time.monotonic()
    with opened(hub, names=[name], transport=transport) as remote:
        assert read_all(remote[name], 200_001) == files[name]
        remote.finish()
        assert remote[name].verified
        assert fault.hits == fault.times
        assert remote.stats.retries >= fault.times
    if fault.status == 429 and fault.kind == "status":
        assert time.monotonic() - started >= 1.0  # Retry-After honoured
    if fault.kind == "drop":  # the bytes received before the connection dropped are kept: asked again from there
        ranges = [(first, end) for file, first, end in state.downloads[before:] if file == name]
        [(first, end)] = [(first, end) for first, end in ranges if first <= 600_000 < end]
        assert (first + int((end - first) * fault.at), end) in ranges, ranges


@pytest.mark.parametrize(
    "fault,says",
    [
        (Fault("status", status=503, times=100), "HTTP 503 from 127.0.0.1"),
        (Fault("drop", at=0.0, times=100), "closed"),
        (Fault("status", status=400), "HTTP 400 from 127.0.0.1"),
    ],
    ids=["503-always", "dropped-always", "400"],
)
@TRANSPORTS
def test_a_range_that_keeps_failing_ends_the_run_in_one_line_with_its_tries(hub, faults, fault, says, transport):
    name = "model-00002-of-00002.safetensors"
    fault = dataclasses.replace(fault, file=name, offset=300_000)  # a fresh one for each case
    faults.append(fault)
    settings = dataclasses.replace(SETTINGS, tries=3, transport=transport)
    with opened(hub, names=[name], settings=settings) as remote:
        with pytest.raises(FetchError) as raised:
            read_all(remote[name], 200_001)
        line = str(raised.value)
        assert "\n" not in line and name in line and REPO in line and says in line, line
        if fault.status == 400:
            assert "tries" not in line  # not worth asking again
        else:
            assert line.endswith("after 3 tries") and raised.value.tries == 3, line
        with pytest.raises(FetchError):  # the run is over: every read says so
            remote[name].pread(0, bytearray(10))
        with pytest.raises(FetchError):
            remote.finish()


def test_a_429_asking_for_longer_than_allowed_ends_the_run_in_one_line(hub, faults):
    name = "model-00002-of-00002.safetensors"
    faults.append(Fault("status", file=name, status=429, retry_after="3600"))
    with opened(hub, names=[name]) as remote:
        with pytest.raises(FetchError, match=r"HTTP 429 from .*, and the Hub asks to wait 3600 s$"):
            remote[name].pread(0, bytearray(1000))


@pytest.mark.parametrize("read", ["all", "part"], ids=["read-whole", "flip-where-no-read-asks"])
def test_a_flipped_byte_is_caught_at_the_end_of_its_file(hub, faults, read):
    _, _, _, files = hub
    name = "model-00001-of-00002.safetensors"
    data = files[name]
    flipped = random.Random(3).randrange(3_000_000, len(data))
    faults.append(Fault("flip", file=name, offset=flipped))
    with opened(hub, names=[name]) as remote:
        file = remote[name]
        if read == "all":
            out = read_all(file, 150_001)
            assert out[flipped] != data[flipped]  # served before the file's end was reached, never placed
        else:
            out = bytearray(1_000_000)
            file.pread(0, out)
        with pytest.raises(IntegrityError) as raised:
            remote.finish()
        line = str(raised.value)
        assert "\n" not in line and name in line and "do not match the Hub's sha256" in line, line
        assert not file.verified


def test_the_same_bytes_read_twice_must_agree(hub, faults):
    """A read no stream continues fetches its pages alone; the block fetched later holding them must bring the same
    bytes (a flip in that later copy is caught by the page's digest, before any read is served from it)."""
    _, _, _, files = hub
    name = "model-00001-of-00002.safetensors"
    out = bytearray(100)
    with opened(hub, names=[name]) as remote:
        remote[name].pread(2_000_000, out)
        assert out == files[name][2_000_000:2_000_100]
        faults.append(Fault("flip", file=name, offset=2_000_050))
        with pytest.raises(IntegrityError, match="came back different when read again"):
            read_all(remote[name], 300_001)


def test_bytes_read_again_after_their_hash_are_checked_against_its_states(hub, faults):
    _, _, _, files = hub
    name = "model-00002-of-00002.safetensors"
    data = files[name]
    with opened(hub, names=[name]) as remote:
        assert read_all(remote[name], 100_001) == data
        remote.finish()
        again = bytearray(300_000)
        remote[name].pread(500_000, again)  # its blocks let go of: fetched again, checked block by block
        assert again == data[500_000:800_000]
        faults.append(Fault("flip", file=name, offset=1_150_000))  # in a block not held: fetched again, flipped
        with pytest.raises(IntegrityError, match="came back different when read again"):
            remote[name].pread(1_120_000, bytearray(50_000))
        assert faults[0].hits == 1


def test_a_commit_pushed_mid_run_does_not_change_what_is_read(hub, faults):
    endpoint, state, commit, files = hub
    repo = "org/moving"
    first = {name: data for name, data in files.items() if name.endswith(".safetensors")}
    old = state.publish(repo, first)
    name = "model-00001-of-00002.safetensors"
    with opened(hub, names=[name], repo=repo, commit=old) as remote:
        file = remote[name]
        out = bytearray(file.size)
        half = file.size // 2
        file.pread(0, memoryview(out)[:half])
        new = state.publish(repo, {name: bytes(reversed(first[name])), "extra.safetensors": b"new"})
        assert new != old and state.at(repo, "main")[0] == new
        faults.append(Fault("expire", file=name))  # the storage link expires: asked for again, at the old commit
        file.pread(half, memoryview(out)[half:])
        assert out == first[name]
        remote.finish()
        assert file.verified and faults[0].hits == 1
    assert f"HEAD /{repo}/resolve/{old}/{name}" in state.requests[-50:]
    assert not [r for r in state.requests if r.startswith(f"HEAD /{repo}/resolve/main/")]


def test_xet_files_are_read_through_hf_xet_and_checked(hub, faults):
    pytest.importorskip("hf_xet")
    endpoint, state, _, files = hub
    data = {name: blob for name, blob in files.items() if name.endswith(".safetensors")}
    commit = state.publish(XET_REPO, data, xet=True)
    before = len(state.requests)
    with opened(hub, repo=XET_REPO, commit=commit) as remote:
        for name, blob in data.items():
            assert remote[name].info.xet_hash is not None
            assert read_all(remote[name], 333_333) == blob
        remote.finish()
        assert all(file.verified for file in remote.files.values())
    asked = state.requests[before:]
    assert any(r.startswith("GET /cas/v1/reconstructions/") for r in asked)
    assert any(r.startswith(f"GET /api/models/{XET_REPO}/xet-read-token/{commit}") for r in asked)
    # a flipped byte in a xorb's range is caught as for any other transfer
    faults.append(Fault("flip", at=0.5))
    name = "model-00002-of-00002.safetensors"
    with opened(hub, names=[name], repo=XET_REPO, commit=commit) as remote:
        read_all(remote[name], 333_333)
        with pytest.raises(IntegrityError, match=name):
            remote.finish()


def test_files_in_the_hub_cache_are_read_in_place_and_checked(hub, tmp_path):
    _, _, commit, files = hub
    name, other = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / commit
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file_name, corrupt in ((name, False), (other, True)):
        data = bytearray(files[file_name])
        digest = hashlib.sha256(data).hexdigest()
        if corrupt:
            data[len(data) // 3] ^= 1
        (blobs / digest).write_bytes(data)
        (snapshot / file_name).symlink_to(os.path.relpath(blobs / digest, snapshot))
    assert expected_of_cached(snapshot / name) == Expected("sha256", hashlib.sha256(files[name]).hexdigest())
    with opened(hub, cache=snapshot) as remote:
        assert type(remote[name]).__name__ == "CachedFile" and remote.streamed_bytes == 0
        assert read_all(remote[name], 500_001) == files[name]
        out = bytearray(1000)
        remote[other].pread(0, out)
        with pytest.raises(IntegrityError) as raised:
            remote.finish()
        assert "\n" not in str(raised.value) and other in str(raised.value) and "corrupted" in str(raised.value)
        assert remote.stats.cached == len(files[name]) + 1000 and remote.stats.fetched == 0


@pytest.mark.parametrize("case", ["missing-file", "bad-token", "unknown-commit"])
def test_what_the_hub_cannot_describe_is_one_line(hub, case):
    endpoint, _, commit, _ = hub
    name, token = "model-00001-of-00002.safetensors", READ_TOKEN
    if case == "missing-file":
        name = "model-00003-of-00002.safetensors"
    elif case == "bad-token":
        token = "hf_not_a_token"
    else:
        commit = "f" * 40
    with pytest.raises(SourceNotFoundError) as raised:
        RemoteFiles.open(REPO, commit, [name], token=token, endpoint=endpoint, settings=SETTINGS)
    line = str(raised.value)
    assert "\n" not in line and line.startswith(f"{REPO}@{commit[:12]}: {name}: cannot be read from the Hub: HTTP")
    assert {"missing-file": "404", "bad-token": "401", "unknown-commit": "404"}[case] in line, line


def test_many_small_ranges_are_read_at_once_and_checked(hub, faults):
    """A plan's reads (headers, quant states): many small ranges, close ones in one request, several requests at once;
    their pages' digests kept for the copy the hash sees."""
    _, state, _, files = hub
    rng = random.Random(11)
    wanted = []
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        for at in range(1000, len(files[name]) - 10_000, 200_000):  # apart: each its own request
            first = at + rng.randrange(1000)
            wanted.append((name, first, first + rng.randrange(1, 3000)))
            if rng.random() < 0.5:  # a neighbour: fetched with it
                wanted.append((name, first + 4000, first + 4000 + rng.randrange(1, 3000)))
    rng.shuffle(wanted)
    before = len(state.downloads)
    with opened(hub) as remote:
        got = remote.read_ranges(wanted)
        assert got == [files[name][first:end] for name, first, end in wanted]
        assert len(state.downloads) - before < len(wanted)  # neighbours merged
        name, first, _ = max(wanted)
        faults.append(Fault("flip", file=name, offset=first))  # the stream's copy of those bytes, flipped
        with pytest.raises(IntegrityError, match="came back different when read again"):
            read_all(remote[name], 300_001)


def test_nothing_is_written_to_disk(hub, monkeypatch):
    """Streamed bytes go from the socket to the blocks and the reads' buffers: no file is opened for writing."""
    import builtins

    _, _, _, files = hub
    opened_for_writing = []
    real_open, real_os_open = builtins.open, os.open

    def watched_open(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+"):
            opened_for_writing.append(file)
        return real_open(file, mode, *args, **kwargs)

    def watched_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            opened_for_writing.append(path)
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", watched_open)
    monkeypatch.setattr(os, "open", watched_os_open)
    with opened(hub) as remote:
        for name, file in remote.files.items():
            assert read_all(file, 1 << 20) == files[name]
        remote.finish()
    assert not opened_for_writing


def test_reads_past_the_end_and_empty_reads(hub):
    _, _, _, files = hub
    name = "model-00002-of-00002.safetensors"
    with opened(hub, names=[name]) as remote:
        remote[name].pread(len(files[name]), bytearray(0))
        with pytest.raises(Exception, match="lie past its end"):
            remote[name].pread(len(files[name]) - 5, bytearray(10))


@TRANSPORTS
def test_a_server_that_cuts_every_answer_short_is_given_up_on_in_one_line(hub, faults, transport):
    # each answer announces the whole range and brings part of it: bytes arrive every time, so the tries of empty
    # answers never run out; answers short in a row must end it, quickly, naming what the server does
    name = "model-00002-of-00002.safetensors"
    faults.append(Fault("drop", file=name, at=0.5, times=10_000))
    settings = dataclasses.replace(SETTINGS, short_answers_most=5, transport=transport)
    started = time.monotonic()
    with opened(hub, names=[name], settings=settings) as remote:
        with pytest.raises(FetchError) as raised:
            read_all(remote[name], 200_001)
    line = str(raised.value)
    assert "\n" not in line and name in line and "ends its answers early (5 answers in a row" in line, line
    assert time.monotonic() - started < 30


def test_a_range_retried_past_its_time_bound_ends_the_run(hub, faults):
    name = "model-00002-of-00002.safetensors"
    faults.append(Fault("drop", file=name, at=0.5, times=10_000))
    settings = dataclasses.replace(SETTINGS, range_seconds_most=0.0, transport="http")
    with opened(hub, names=[name], settings=settings) as remote:
        with pytest.raises(FetchError, match=r"still not whole after 0 s of tries$"):
            read_all(remote[name], 200_001)


def test_a_file_of_one_block_read_in_scattered_pieces_is_fetched_once(hub):
    """A file no larger than a block (a small shard, an adapter) read in small pieces here and there: fetched whole at
    its first read, in one request, and every later piece served from that copy."""
    endpoint, state, _, _ = hub
    data = random.Random(5).randbytes(200_003)
    assert len(data) <= SETTINGS.block_bytes
    commit = state.publish("org/one-block", {"model.safetensors": data})
    rng = random.Random(6)
    pieces = [(at, at + rng.randrange(1, 3000)) for at in (rng.randrange(len(data) - 3000) for _ in range(40))]
    pieces += pieces[:10]  # the same bytes asked again
    before = len(state.downloads)
    with RemoteFiles.open(
        "org/one-block", commit, ["model.safetensors"], token=READ_TOKEN, endpoint=endpoint, settings=SETTINGS
    ) as remote:
        for first, end in pieces:
            into = bytearray(end - first)
            remote["model.safetensors"].pread(first, into)
            assert into == data[first:end]
        remote.finish()
        assert state.downloads[before:] == [("model.safetensors", 0, len(data))]
        assert (remote.stats.fetched, remote.stats.fetched_again) == (len(data), 0)
