"""Conversions of Hub repos streamed (the default) against the fake Hub (tests/fixtures/fake_hub.py: commits, CDN
redirects, LFS sha256, ranges, faults): byte for byte the output of the downloaded route (``--download``) for
bitsandbytes 4-bit and 8-bit, with an adapter from the Hub, to GGUF, in a batch; verify streams too; every fault
survived or reported in one line with nothing placed; a flipped byte caught, streamed or downloaded; a commit pushed
mid-run ignored; the disk a streamed run uses at most the output and the small files.

Each run is the command line in a process of its own (huggingface_hub reads HF_ENDPOINT when imported), with the
stream's blocks and budget made small (``SMALL``) so that the test repos' files span many blocks, streams and
evictions, and retries come quickly."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fixtures.fake_hub import READ_TOKEN, Fault, client_env, serve

BNB4, BNB8, LORA = "org/llama-bnb-4bit", "org/tiny-llama-bnb-8bit", "org/llama-lora"

SMALL = (
    "import dataclasses\n"
    "from nf4convert.hub import weights\n"
    "made = weights.stream_settings\n"
    "small = dict(block_bytes=1 << 16, memory_bytes=1 << 18, requests_at_once=4, ahead_blocks=2, tries=3,\n"
    "             wait_first=0.02, wait_most=0.1, timeout=1.0)\n"
    "weights.stream_settings = lambda settings: dataclasses.replace(made(settings), **small)\n"
)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The fake Hub with a 4-bit Llama (with a tokenizer, for GGUF), an 8-bit one and a LoRA adapter of the first;
    references (the downloaded route's outputs) made once each, as a test first asks for them."""
    from fixtures.adapters import make_adapter
    from fixtures.checkpoints import build as build4
    from fixtures.checkpoints8 import build as build8
    from fixtures.trained_tokenizers import sentencepiece_tokenizer

    root = tmp_path_factory.mktemp("hub-streamed")
    bnb4 = build4(root / "bnb4", "llama-nf4-dq", seed=3)
    sentencepiece_tokenizer(bnb4)
    bnb8 = build8(root / "bnb8", "llama-8bit-bf16", seed=5)
    lora = make_adapter(root / "lora", "linear", seed=7, base_model=BNB4)
    with serve(lifetime=3600) as (endpoint, state):
        for repo, folder in ((BNB4, bnb4), (BNB8, bnb8), (LORA, lora)):
            state.publish(repo, files_of(folder))
        yield Hub(endpoint, state, root, {BNB4: files_of(bnb4), BNB8: files_of(bnb8), LORA: files_of(lora)})


class Hub:
    def __init__(self, endpoint, state, root, repos):
        self.endpoint, self.state, self.root, self.repos = endpoint, state, root, repos
        self.references: dict[tuple, Path] = {}

    def reference(self, *args: str) -> Path:
        """The output of ``args`` converted with --download (once per args)."""
        if args not in self.references:
            out = self.root / f"reference-{len(self.references)}" / ("out.gguf" if "--gguf-type" in args else "out")
            home = self.root / f"reference-home-{len(self.references)}"
            done = run(self, out, *args, "--download", home=home)
            assert done.returncode == 0 and "read from the Hub cache" in done.stdout, done.stderr
            self.references[args] = out
        return self.references[args]


@pytest.fixture
def faults(hub):
    hub.state.faults.clear()
    yield hub.state.faults
    hub.state.faults.clear()
    hub.state.bandwidth, hub.state.latency = None, 0.0


def run(hub: Hub, out: Path | None, *args: str, home: Path, tmp: Path | None = None, watch=(), **env: str | None):
    """The command line (``out``: its -o) in a process of its own with its own HF_HOME (and TMPDIR), the stream made
    small; the result, with ``peak`` the most disk the folders ``watch`` held at once while it ran. ``env``: variables
    set (None: unset)."""
    environ = client_env(hub.endpoint, home, HF_HUB_DISABLE_XET="1", HF_TOKEN=READ_TOKEN)
    for key, value in env.items():
        environ.pop(key, None) if value is None else environ.__setitem__(key, value)
    if tmp is not None:
        tmp.mkdir(parents=True, exist_ok=True)
        environ["TMPDIR"] = str(tmp)
    command = [
        sys.executable,
        "-c",
        f"import sys\n{SMALL}\nfrom nf4convert.cli.commands import main\nmain(sys.argv[1:])",
    ]
    arguments = [*args, *(["-o", str(out)] if out is not None else []), "--device", "cpu", "-q"]
    peak = DiskPeak(watch)
    try:
        done = subprocess.run([*command, *arguments], capture_output=True, text=True, env=environ, timeout=600)
    finally:
        done_peak = peak.stop()
    done.peak = done_peak
    return done


class DiskPeak:
    """The most bytes (allocated blocks, each inode once) the files under ``folders`` held at once, sampled."""

    def __init__(self, folders):
        self.folders, self.peak = list(folders), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while True:
            self.peak = max(self.peak, used(self.folders))
            if self._stop.wait(0.01):
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, used(self.folders))
        return self.peak


def used(folders) -> int:
    """Bytes of disk the files under ``folders`` take (allocated blocks: a sparse file's holes take none)."""
    seen, total = set(), 0
    for folder in folders:
        for root, _, names in os.walk(folder):
            for name in names:
                try:
                    status = os.lstat(os.path.join(root, name))
                except OSError:  # gone meanwhile
                    continue
                if status.st_ino not in seen:
                    seen.add(status.st_ino)
                    total += status.st_blocks * 512
    return total


def error_lines(done) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.strip() and "kernels-community" not in line]


def cached_blobs(home: Path) -> set[str]:
    """The sha256 of every file the Hub cache in ``home`` holds."""
    return {hashlib.sha256(p.read_bytes()).hexdigest() for p in (home / "hub").rglob("blobs/*") if p.is_file()}


def weight_hashes(hub: Hub, repo: str) -> set[str]:
    return {hashlib.sha256(data).hexdigest() for name, data in hub.repos[repo].items() if name.endswith(".safetensors")}


CASES = {
    "4-bit": (BNB4,),
    "8-bit": (BNB8,),
    "adapter from the Hub": (BNB4, "--adapter", LORA),
    "adapter as SOURCE": (LORA,),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_streamed_conversion_is_the_downloaded_ones_bytes_and_keeps_no_copy(hub, tmp_path, case):
    args = CASES[case]
    reference = hub.reference(*args)
    home, tmp, out = tmp_path / "home", tmp_path / "tmp", tmp_path / "out"
    done = run(hub, out, *args, *(["--verify"] if case != "8-bit" else []), home=home, tmp=tmp, watch=[tmp_path])
    assert done.returncode == 0, done.stderr
    assert files_of(out) == files_of(reference)
    summary = done.stdout.splitlines()[0]
    assert "streamed from the Hub, no copy kept" in summary, summary
    assert ("read from the Hub cache" in summary) == (LORA in args), summary  # an adapter is small: downloaded
    if case != "8-bit":
        assert "OK: bit-exact" in done.stdout  # verify streamed the source again, checked
    base = BNB8 if case == "8-bit" else BNB4
    assert not cached_blobs(home) & weight_hashes(hub, base)  # the base's weights never reached the disk
    assert list(tmp.iterdir()) == []  # the plan's copy is gone

    # The disk it used at its fullest (the Hub cache, the temporary folder, the output and its staging folder): the
    # output, the small files (in the cache, and copied for the plan) and the headers and quant states of the weight
    # files (sparse copies), nothing else of the weights; the downloaded route's cache holds them whole.
    small = sum(len(data) for name, data in hub.repos[base].items() if not name.endswith(".safetensors"))
    adapter = sum(len(data) for data in hub.repos[LORA].values()) if LORA in args else 0
    bound = used([out]) + 2 * (small + adapter) + held_pages(hub, base)
    assert done.peak <= bound, (done.peak, bound)
    if case == "4-bit":
        weights = sum(len(data) for name, data in hub.repos[base].items() if name.endswith(".safetensors"))
        again = run(hub, tmp_path / "again", *args, "--download", home=tmp_path / "home2", watch=[tmp_path / "home2"])
        assert again.returncode == 0 and again.peak >= weights, (again.peak, weights)


def held_pages(hub: Hub, repo: str, page: int = 4096) -> int:
    """The disk a plan's sparse copies of ``repo``'s weight files take at most: the pages of each header and of each
    tensor a plan reads (and one more page each, for where the file system allocates ahead)."""
    from nf4convert.formats.base import plan_reads
    from nf4convert.safetensors_io.read import read_header

    total = 0
    for name, data in hub.repos[repo].items():
        if name.endswith(".safetensors"):
            path = hub.root / "headers" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            header_end = 8 + int.from_bytes(data[:8], "little")
            spans = [(0, header_end)] + [
                (t.begin, t.end) for t in read_header(path)[0].values() if plan_reads().search(t.name)
            ]
            total += sum((end // page - begin // page + 2) * page for begin, end in spans)
    return total


def test_a_streamed_gguf_is_the_downloaded_ones_bytes(hub, tmp_path):
    args = (BNB4, "--adapter", LORA, "--gguf-type", "q8_0")
    reference = hub.reference(*args)
    out = tmp_path / "out.gguf"  # as the reference is named (the name is in the file's metadata)
    done = run(hub, out, *args, "--verify", home=tmp_path / "home")
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == reference.read_bytes()
    assert "streamed from the Hub" in done.stdout and "OK: bit-exact with llama.cpp's converter" in done.stdout


def test_a_streamed_llama_quantize_type_is_llama_quantizes_file(hub, tmp_path):
    from fixtures.llama_cpp import LlamaCpp

    ref = LlamaCpp.ready()
    base = hub.reference(BNB4, "--adapter", LORA, "--gguf-type", "bf16")  # llama-quantize's input
    out = tmp_path / "out.gguf"  # as the reference is named (the name is in the file's metadata)
    done = run(hub, out, BNB4, "--adapter", LORA, "--gguf-type", "q4_k_m", home=tmp_path / "home")
    assert done.returncode == 0 and "streamed from the Hub" in done.stdout, done.stderr
    assert out.read_bytes() == ref.quantize_file(base, tmp_path / "theirs.gguf", "q4_k_m").read_bytes()


def test_a_batch_streams_each_source(hub, tmp_path):
    done = run(hub, None, "batch", BNB4, BNB8, "-o", str(tmp_path / "batch"), home=tmp_path / "home")
    assert done.returncode == 0, done.stderr
    made = sorted((tmp_path / "batch").iterdir())
    assert len(made) == 2, made
    for repo in (BNB4, BNB8):  # the cards' titles are the outputs' names: the rest is the same
        reference = without_card(files_of(hub.reference(repo)))
        assert any(without_card(files_of(folder)) == reference for folder in made), repo
    assert not cached_blobs(tmp_path / "home") & (weight_hashes(hub, BNB4) | weight_hashes(hub, BNB8))


def without_card(files: dict[str, bytes]) -> dict[str, bytes]:
    assert "README.md" in files
    return {name: data for name, data in files.items() if name != "README.md"}


def test_a_dry_run_says_what_a_conversion_would_stream(hub, tmp_path):
    weights = sum(len(data) for name, data in hub.repos[BNB4].items() if name.endswith(".safetensors"))
    streamed = run(hub, tmp_path / "out", BNB4, "--dry-run", home=tmp_path / "home")
    assert streamed.returncode == 0, streamed.stderr
    assert f"weights: {weights / 1e6:.1f} MB to stream from the Hub as they are converted; no copy kept on disk" in (
        streamed.stdout.splitlines()
    ), streamed.stdout
    downloaded = run(hub, tmp_path / "out", BNB4, "--dry-run", "--download", home=tmp_path / "home")
    assert f"weights: {weights / 1e6:.1f} MB to download into the Hub cache first (--download), then read there" in (
        downloaded.stdout.splitlines()
    ), downloaded.stdout
    assert not (tmp_path / "out").exists() and not cached_blobs(tmp_path / "home") & weight_hashes(hub, BNB4)


def shard(hub: Hub, repo: str, number: int) -> str:
    return sorted(name for name in hub.repos[repo] if name.endswith(".safetensors"))[number]


def test_every_fault_is_survived(hub, faults, tmp_path):
    """A dropped connection, a 5xx, a 429 with Retry-After, a stalled read, a truncated body and an expired storage
    link, each on a range the conversion reads: each range tried again, the bytes those that were published."""
    reference = hub.reference(BNB4)
    first, second, third, fourth = (shard(hub, BNB4, n) for n in range(4))
    faults += [
        Fault("drop", file=first, offset=20_000, at=0.3),
        Fault("status", file=first, offset=110_000, status=503),
        Fault("status", file=second, offset=20_000, status=429, retry_after="1"),
        Fault("stall", file=second, offset=110_000, at=0.2, stall=4.0),
        Fault("truncate", file=third, offset=110_000, at=0.4),
        Fault("expire", file=fourth, offset=30_000),
    ]
    out = tmp_path / "out"
    done = run(hub, out, BNB4, home=tmp_path / "home")
    assert done.returncode == 0, done.stderr
    assert [fault.hits for fault in faults] == [1] * len(faults)
    assert files_of(out) == files_of(reference)


@pytest.mark.parametrize("route", ["streamed", "downloaded"])
def test_a_range_that_keeps_failing_ends_the_run_in_one_line_and_places_nothing(hub, faults, tmp_path, route):
    name = shard(hub, BNB4, 1)
    faults.append(Fault("status", file=name, offset=120_000, status=500, times=10_000))
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    extra = ["--download"] if route == "downloaded" else []
    done = run(hub, out, BNB4, *extra, home=tmp_path / "home", tmp=tmp)
    lines = error_lines(done)
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("Error: "), done.stderr
    assert "500" in lines[0], lines[0]
    if route == "streamed":  # (a download's line is huggingface_hub's, as before)
        assert name in lines[0] and "after 3 tries" in lines[0], lines[0]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["home", "tmp"]  # no partial left
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize("route", ["streamed", "downloaded"])
def test_a_byte_flipped_on_the_way_is_caught_and_nothing_placed(hub, faults, tmp_path, route):
    name = shard(hub, BNB4, 2)
    size = len(hub.repos[BNB4][name])
    faults.append(Fault("flip", file=name, offset=size - 1000, times=10_000))  # every copy of that byte
    out = tmp_path / "out"
    extra = ["--download"] if route == "downloaded" else []
    done = run(hub, out, BNB4, *extra, home=tmp_path / "home")
    lines = error_lines(done)
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert name in lines[0] and "sha256" in lines[0] and "corrupted" in lines[0], lines[0]
    assert faults[0].hits >= 1 and not out.exists()


def test_a_commit_pushed_mid_run_does_not_change_the_output(hub, faults, tmp_path):
    from fixtures.checkpoints import build as build4

    reference = hub.reference(BNB4)
    first = hub.state.at(BNB4, "main")[0]
    other = files_of(build4(tmp_path / "other", "llama-nf4-dq", seed=11))
    hub.state.bandwidth = 400_000  # the run takes a few seconds
    pushed = threading.Event()

    def push_once_streaming():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any(name.endswith(".safetensors") for name, _, _ in list(hub.state.downloads)):
                hub.state.publish(BNB4, other)
                pushed.set()
                return
            time.sleep(0.005)

    hub.state.downloads.clear()
    pusher = threading.Thread(target=push_once_streaming, daemon=True)
    pusher.start()
    out = tmp_path / "out"
    try:
        done = run(hub, out, BNB4, home=tmp_path / "home")
    finally:
        pusher.join()
        hub.state.publish(BNB4, hub.repos[BNB4])  # main as it was, for the other tests
    assert pushed.is_set() and hub.state.at(BNB4, "main")[0] == first
    assert done.returncode == 0, done.stderr
    assert files_of(out) == files_of(reference)
    assert first in (out / "README.md").read_text()  # the card names the commit read


def test_offline_reads_the_weights_a_download_left_and_checks_them(hub, tmp_path):
    home = tmp_path / "home"
    first = run(hub, tmp_path / "streamed" / "out", BNB4, home=home)
    assert first.returncode == 0, first.stderr
    offline = run(hub, tmp_path / "offline", BNB4, home=home, HF_HUB_OFFLINE="1")
    lines = error_lines(offline)
    assert offline.returncode == 1 and len(lines) == 1 and "not in the Hub cache" in lines[0], offline.stderr
    downloaded = run(hub, tmp_path / "downloaded", BNB4, "--download", home=home)
    assert downloaded.returncode == 0, downloaded.stderr
    offline = run(hub, tmp_path / "offline" / "out", BNB4, home=home, HF_HUB_OFFLINE="1")
    assert offline.returncode == 0 and "read from the Hub cache" in offline.stdout, offline.stderr
    assert files_of(tmp_path / "offline" / "out") == files_of(tmp_path / "streamed" / "out")

    # a blob of the cache changed since: caught as it is read, nothing placed
    blob = next(p for p in (home / "hub").rglob("blobs/*") if p.stat().st_size > 50_000)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.chmod(0o644)
    blob.write_bytes(bytes(data))
    changed = run(hub, tmp_path / "changed", BNB4, home=home, HF_HUB_OFFLINE="1")
    lines = error_lines(changed)
    assert changed.returncode == 1 and len(lines) == 1 and "the Hub cache's copy of" in lines[0], changed.stderr
    assert not (tmp_path / "changed").exists()


def test_without_a_token_the_repo_is_not_found_and_with_one_it_streams(hub, tmp_path):
    environ = {"HF_TOKEN": None}
    done = run(hub, tmp_path / "out", BNB4, home=tmp_path / "home", **environ)
    lines = error_lines(done)
    assert done.returncode == 1 and len(lines) == 1 and "give a token" in lines[0], done.stderr
    done = run(hub, tmp_path / "out", BNB4, "--token", READ_TOKEN, home=tmp_path / "home", **environ)
    assert done.returncode == 0 and "streamed from the Hub" in done.stdout, done.stderr


def test_a_repo_on_xet_is_streamed_through_hf_xet(hub, tmp_path):
    pytest.importorskip("hf_xet")
    repo = "org/xet-llama-bnb-4bit"
    hub.state.publish(repo, hub.repos[BNB4], xet=True)
    before = len(hub.state.requests)
    out = tmp_path / "out"
    done = run(hub, out, repo, home=tmp_path / "home", HF_HUB_DISABLE_XET=None)
    assert done.returncode == 0 and "streamed from the Hub" in done.stdout, done.stderr
    assert without_card(files_of(out)) == without_card(files_of(hub.reference(BNB4)))
    assert any(r.startswith("GET /cas/v1/reconstructions/") for r in hub.state.requests[before:])
    assert not cached_blobs(tmp_path / "home") & weight_hashes(hub, BNB4)


@pytest.mark.parametrize("route", ["streamed", "downloaded"])
def test_a_header_byte_flipped_on_the_way_is_the_downloads_fault_not_the_checkpoints(hub, faults, tmp_path, route):
    # the plan reads the header before any hash is checked: its refusal must not blame the checkpoint, and a
    # download must not leave the bad bytes in the cache under the file's true name
    name = shard(hub, BNB4, 1)
    data = hub.repos[BNB4][name]
    at = data.index(b'"dtype"') + 3  # inside the header's JSON: a key no header has
    faults.append(Fault("flip", file=name, offset=at, times=1))
    extra = ["--download"] if route == "downloaded" else []
    home = tmp_path / "home"
    done = run(hub, tmp_path / "out", BNB4, *extra, home=home)
    lines = error_lines(done)
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert name in lines[0] and "corrupted" in lines[0] and "run again" in lines[0], lines[0]
    assert faults[0].hits == 1 and not (tmp_path / "out").exists()
    if route == "downloaded":
        for blob in (home / "hub").rglob("blobs/*"):  # no blob holds bytes other than those it is named by
            if len(blob.name) == 64:
                assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name, blob
    again = run(hub, tmp_path / "again" / "out", BNB4, *extra, home=home)
    assert again.returncode == 0, again.stderr
    assert files_of(tmp_path / "again" / "out") == files_of(hub.reference(BNB4))
