"""Streaming a repo's weights from a Hub-like server (hub/stream/) beside downloading them and beside working on a
local copy: wall time and peak host memory, at a few bandwidths, with per-request latency.

    python benchmarks/bench_hub_stream.py [--size-mb 1024] [--files 2] [--bandwidths 100,500,0] [--latency-ms 20]
                                          [--piece-mb 4] [--work sleep:400] [--shards-at-once 1] [--xet]
                                          [--steps download,stream,local,stream+work] [--json FILE]

The server is tests/fixtures/fake_hub.py in a process of its own: the repo's files (random bytes, seeded) published as
LFS files, each resolve redirected to its CDN, ranges answered 206, the CDN a link of ``--bandwidths`` MB/s (0:
unlimited) shared by every download, ``--latency-ms`` before each answer; with ``--xet`` the files are Xet files
(uploaded through hf_xet, read through its ranged streams). For each bandwidth, each step in a fresh process:

  download      huggingface_hub's snapshot_download of the repo at its commit into an empty cache (what a conversion
                does first today), the cache removed after
  stream        every byte read through RemoteFiles as the pipeline reads (three threads, pieces of ``--piece-mb`` in
                file order, files one after the other; with ``--shards-at-once N``, each file read at N places at once,
                a piece of each in turn, as N output shards written at once read it), and every file's hash checked
                (``finish``): nothing kept
  local         the work (below) on a local copy of the files (read from the page cache): a local conversion's time
  stream+work   the work on the pieces as they are streamed: a streamed conversion's time

The work stands for a conversion's: ``sleep:MBPS`` (the CPU free while the pieces are made, as on a GPU), or
``cpu:N`` (N numpy passes over each piece's bytes, as a CPU route competes for the cores). The figure of merit:
stream+work / max(download, local), which the Hub streaming aims to keep at or under 1.1. Peak RssAnon of each step
is sampled every 10 ms in its process. A markdown table on stdout; JSON with ``--json``.

With ``--convert``, the real conversion instead of a stand-in:

    python benchmarks/bench_hub_stream.py --convert [--layers 4] [--vocab 32000] [--device cpu] [--bandwidths ...]

a Llama-8B-shaped bitsandbytes 4-bit checkpoint of ``--layers`` layers (bench_convert.build_source) published on the
server, and for each bandwidth, each a command line in a fresh process with an empty Hub cache:

  download          huggingface_hub's snapshot_download of the repo (the download alone)
  local             nf4convert of the local folder (the conversion alone; measured once)
  download+convert  nf4convert REPO --download: today's route, the download then the conversion
  stream            nf4convert REPO: the weights streamed into the conversion

with wall time, peak RssAnon, the most disk the Hub cache and TMPDIR held at once, and what the summary says was
streamed. The streamed output is compared byte for byte with the local one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPO = "bench/stream-bnb-4bit"
TOKEN = "hf_read_token"  # the fake Hub's read token


def file_names(count: int) -> list[str]:
    return [f"model-{n:05d}-of-{count:05d}.safetensors" for n in range(1, count + 1)]


def file_bytes(size: int, count: int, seed: int) -> dict[str, bytes]:
    """``count`` files of random bytes, ``size`` in all (odd sizes), the same for every process with the seed."""
    import numpy as np

    rng = np.random.default_rng(seed)
    each = size // count
    return {name: rng.bytes(each + 1 + 2 * n) for n, name in enumerate(file_names(count))}


# -- the server, in its own process ----------------------------------------------------------------------------------
def serve(args) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures.fake_hub import serve as fake_hub

    if args.folder:  # a checkpoint's files, as they are
        folder = Path(args.folder)
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    else:
        files = file_bytes(args.size_mb << 20, args.files, args.seed)
    with fake_hub(lifetime=24 * 3600) as (endpoint, hub):
        commit = hub.publish(REPO, files, xet=args.xet)
        hub.bandwidth = args.bandwidth * 1e6 if args.bandwidth else None
        hub.upload_bandwidth = args.upload_bandwidth * 1e6 if args.upload_bandwidth else None
        hub.latency = args.latency_ms / 1000
        print(json.dumps({"endpoint": endpoint, "commit": commit}), flush=True)
        sys.stdin.read()  # until the benchmark closes it


# -- the steps, each in its own process ------------------------------------------------------------------------------
class Peak:
    """Peak RssAnon of this process, sampled every 10 ms."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.wait(0.01):
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    self.peak = max(self.peak, int(line.split()[1]))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 1024


def make_work(spec: str):
    """The stand-in for a conversion's making of a piece, from ``sleep:MBPS`` (one piece made at a time, at that
    rate: a GPU's) or ``cpu:N`` (N numpy passes over its bytes, on the reading threads: a CPU route's)."""
    import numpy as np

    kind, _, value = spec.partition(":")
    if kind == "sleep":
        rate = float(value) * 1e6
        maker = threading.Lock()

        def work(piece):
            with maker:
                time.sleep(len(piece) / rate)

    elif kind == "cpu":
        passes = int(value)

        def work(piece):
            data = np.frombuffer(piece, dtype=np.uint8)
            scratch = np.empty(len(data), dtype=np.float16)
            for _ in range(passes):
                np.multiply(data, 0.5, out=scratch)

    else:
        raise SystemExit(f"--work {spec!r}: sleep:MBPS or cpu:N")
    return work


def run_pieces(files: list[tuple[int, object]], piece: int, work, threads: int = 3, places: int = 1) -> None:
    """Read every file front to back, ``threads`` pieces at once (the pipeline's read-ahead), each piece then
    worked on: ``files`` is (size, read(offset, buffer)) in order; each file read at ``places`` places at once."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = []
    for size, read in files:
        bounds = [size * k // places for k in range(places + 1)]
        lanes = [
            [(read, offset, min(piece, bounds[k + 1] - offset)) for offset in range(bounds[k], bounds[k + 1], piece)]
            for k in range(places)
        ]
        for turn in range(max(len(lane) for lane in lanes)):
            jobs += [lane[turn] for lane in lanes if turn < len(lane)]
    buffers = [bytearray(piece) for _ in range(threads * 2)]
    free = list(range(len(buffers)))
    lock = threading.Lock()

    def one(job):
        read, offset, count = job
        with lock:
            slot = free.pop()
        try:
            view = memoryview(buffers[slot])[:count]
            read(offset, view)
            if work is not None:
                work(view)
        finally:
            with lock:
                free.append(slot)

    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(one, jobs):
            pass


def step(args) -> None:
    endpoint, commit = args.endpoint, args.commit
    names = file_names(args.files)
    work = make_work(args.work) if args.step in ("local", "stream+work") else None
    import huggingface_hub  # noqa: F401  (a conversion has it imported before it reads: not timed)

    from nf4convert.hub import stream  # noqa: F401

    peak = Peak()
    result: dict = {}
    started = time.perf_counter()
    if args.step == "download":
        from huggingface_hub import snapshot_download

        cache = tempfile.mkdtemp(prefix="bench-hub-cache-")
        try:
            snapshot_download(REPO, revision=commit, cache_dir=cache, token=TOKEN)
            result["seconds"] = time.perf_counter() - started
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    elif args.step == "local":
        folder = Path(args.local)
        descriptors = [os.open(folder / name, os.O_RDONLY) for name in names]

        def reader(descriptor):
            def read(offset, view):
                done = 0
                while done < len(view):
                    done += os.preadv(descriptor, [view[done:]], offset + done)

            return read

        files = [(os.fstat(d).st_size, reader(d)) for d in descriptors]
        run_pieces(files, args.piece_mb << 20, work, places=args.shards_at_once)
        result["seconds"] = time.perf_counter() - started
    else:
        from nf4convert.hub.stream import RemoteFiles

        with RemoteFiles.open(REPO, commit, names, token=TOKEN, endpoint=endpoint) as remote:
            opened = time.perf_counter() - started
            files = [(remote[name].size, remote[name].pread) for name in names]
            run_pieces(files, args.piece_mb << 20, work, places=args.shards_at_once)
            read = time.perf_counter() - started
            remote.finish()
            result.update(seconds=time.perf_counter() - started, opened=opened, read=read)
            result["stats"] = remote.stats.__dict__
    result["peak_anon_mb"] = peak.stop()
    print(json.dumps(result))


# -- the real conversion ---------------------------------------------------------------------------------------------
def convert_benchmark(args) -> None:
    """``--convert``: the steps of the module's docstring on a synthesized checkpoint, a row per bandwidth and step."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests"))
    from bench_convert import build_source, measure

    from fixtures.fake_hub import READ_TOKEN

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-hub-convert-"))
    source = workdir / "stream-bnb-4bit"
    if not (source / "config.json").is_file():
        shutil.rmtree(source, ignore_errors=True)
        build_source(source, args.layers, vocab_size=args.vocab)
    size = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    cli = [
        sys.executable,
        "-m",
        "nf4convert",
        "-q",
        "--device",
        args.device,
        *(["--dtype", args.dtype] if args.dtype else []),
    ]
    rows, local = [], None
    try:
        for bandwidth in [float(b) for b in args.bandwidths.split(",")]:
            server_command = [
                sys.executable,
                __file__,
                "--serve",
                "--folder",
                str(source),
                "--bandwidth",
                str(bandwidth),
            ]
            server_command += ["--latency-ms", str(args.latency_ms)] + (["--xet"] if args.xet else [])
            with subprocess.Popen(server_command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as server:
                ready = json.loads(server.stdout.readline())
                env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
                env.update(HF_ENDPOINT=ready["endpoint"], HF_TOKEN=READ_TOKEN, HF_HUB_DISABLE_TELEMETRY="1")
                env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
                if not args.xet:
                    env["HF_HUB_DISABLE_XET"] = "1"
                out = workdir / "out"
                steps = {
                    "download": [sys.executable, "-c", DOWNLOAD, REPO],
                    "local": [*cli, str(source), "-o", str(out)],
                    "download+convert": [*cli, REPO, "--download", "-o", str(out)],
                    "stream": [*cli, REPO, "-o", str(out)],
                }
                for name in args.steps.split(","):
                    if name == "local" and local is not None:
                        rows.append({**local, "bandwidth": bandwidth})
                        continue
                    runs = []
                    for _ in range(args.repeat):
                        home, tmp = workdir / "home", workdir / "tmp"
                        for folder in (home, tmp, out):
                            shutil.rmtree(folder, ignore_errors=True)
                        tmp.mkdir()
                        subprocess.run(["sync"], check=True)  # the step before's writes not flushed during this one
                        disk = DiskPeak([home, tmp])
                        try:
                            one = measure(
                                steps[name], env={**env, "HF_HOME": str(home), "TMPDIR": str(tmp)}, output=True
                            )
                        finally:
                            one["disk_mb"] = disk.stop() / 1e6
                        summary = one.pop("stdout").strip().splitlines()
                        one["summary"] = summary[0].split("; ", 1)[1] if summary and "; " in summary[0] else ""
                        runs.append(one)
                    row = sorted(runs, key=lambda one: one["seconds"])[len(runs) // 2]  # the median run
                    row.update(bandwidth=bandwidth, step=name, runs=[round(one["seconds"], 2) for one in runs])
                    if name == "local":
                        local = row
                        reference = digests(out)
                    if name == "stream" and "local" in args.steps.split(","):
                        row["same_bytes"] = digests(out) == reference
                    rows.append(row)
                    print(f"{bandwidth:g} MB/s {name}: {json.dumps(row)}", file=sys.stderr, flush=True)
                shutil.rmtree(out, ignore_errors=True)
                server.stdin.close()
                server.wait(timeout=60)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\n{args.layers}-layer Llama-8B-shaped bnb-4bit checkpoint, {size / 1e9:.2f} GB of weights, "
        f"vocab {args.vocab}, latency {args.latency_ms:g} ms, --device {args.device}; "
        f"{platform.node()}, {os.cpu_count()} CPUs\n"
    )
    print("| link MB/s | step | seconds (runs) | source MB/s | peak RssAnon MB | cache+tmp MB | said | same bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        runs = ", ".join(f"{seconds:.1f}" for seconds in row["runs"])
        print(
            f"| {row['bandwidth']:g} | {row['step']} | {row['seconds']:.2f} ({runs}) | "
            f"{size / row['seconds'] / 1e6:.0f} | {row['peak_anon_mb']:.0f} | {row['disk_mb']:.0f} | "
            f"{row['summary']} | {row.get('same_bytes', '')} |"
        )
    by = {(row["bandwidth"], row["step"]): row["seconds"] for row in rows}
    for bandwidth in sorted({row["bandwidth"] for row in rows}):
        parts = [by.get((bandwidth, s)) for s in ("download", "local", "stream", "download+convert")]
        if None not in parts:
            print(
                f"\nlink {bandwidth:g} MB/s: stream / max(download, local) = {parts[2] / max(parts[0], parts[1]):.2f}; "
                f"download+convert / stream = {parts[3] / parts[2]:.2f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


DOWNLOAD = "import sys; from huggingface_hub import snapshot_download; snapshot_download(sys.argv[1])"


class DiskPeak:
    """The most bytes (allocated blocks) the files under ``folders`` held at once, sampled every 50 ms."""

    def __init__(self, folders):
        self.folders, self.peak = folders, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.wait(0.05):
            total = 0
            for folder in self.folders:
                for root, _, names in os.walk(folder):
                    for name in names:
                        try:
                            total += os.lstat(os.path.join(root, name)).st_blocks * 512
                        except OSError:
                            pass
            self.peak = max(self.peak, total)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def digests(folder: Path) -> dict[str, str]:
    import hashlib

    return {
        p.name: hashlib.file_digest(open(p, "rb"), "sha256").hexdigest()  # noqa: SIM115
        for p in sorted(folder.glob("*.safetensors"))
    }


# -- the benchmark ---------------------------------------------------------------------------------------------------
def run_step(name: str, args, server: dict, local: Path | None = None) -> dict:
    command = [
        sys.executable,
        __file__,
        "--step",
        name,
        "--endpoint",
        server["endpoint"],
        "--commit",
        server["commit"],
        "--files",
        str(args.files),
        "--piece-mb",
        str(args.piece_mb),
        "--work",
        args.work,
        "--shards-at-once",
        str(args.shards_at_once),
    ]
    if local is not None:
        command += ["--local", str(local)]
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    env.update(HF_ENDPOINT=server["endpoint"], HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="bench-hub-home-") as home:
        env["HF_HOME"] = home
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"step {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--files", type=int, default=2)
    parser.add_argument("--bandwidths", default="100,500,0", help="MB/s of the server's link, 0 unlimited")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--piece-mb", type=int, default=4)
    parser.add_argument("--work", default="sleep:400")
    parser.add_argument("--shards-at-once", type=int, default=1)
    parser.add_argument("--xet", action="store_true")
    parser.add_argument("--steps", default="download,stream,local,stream+work")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument("--convert", action="store_true", help="the real conversion (see the docstring)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--workdir", help="with --convert: where the checkpoint is built (kept)")
    parser.add_argument("--repeat", type=int, default=1, help="with --convert: runs of each step (the median is shown)")
    # internal: the server's process and the steps' processes
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bandwidth", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--upload-bandwidth", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--commit", help=argparse.SUPPRESS)
    parser.add_argument("--local", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args)
    if args.step:
        return step(args)
    if args.convert:
        if args.steps == parser.get_default("steps"):
            args.steps = "download,local,download+convert,stream"
        return convert_benchmark(args)

    steps = args.steps.split(",")
    local = None
    if "local" in steps:
        local = Path(tempfile.mkdtemp(prefix="bench-hub-local-"))
        for name, data in file_bytes(args.size_mb << 20, args.files, args.seed).items():
            (local / name).write_bytes(data)
    rows = []
    try:
        for bandwidth in [float(b) for b in args.bandwidths.split(",")]:
            server_command = [
                sys.executable,
                __file__,
                "--serve",
                "--size-mb",
                str(args.size_mb),
                "--files",
                str(args.files),
                "--seed",
                str(args.seed),
                "--bandwidth",
                str(bandwidth),
                "--latency-ms",
                str(args.latency_ms),
            ] + (["--xet"] if args.xet else [])
            with subprocess.Popen(server_command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as server:
                ready = json.loads(server.stdout.readline())
                for name in steps:
                    result = run_step(name, args, ready, local if name == "local" else None)
                    rows.append({"bandwidth": bandwidth, "step": name, **result})
                    print(f"{bandwidth:g} MB/s {name}: {json.dumps(result)}", file=sys.stderr, flush=True)
                server.stdin.close()
                server.wait(timeout=60)
    finally:
        if local is not None:
            shutil.rmtree(local, ignore_errors=True)

    size = sum(len(data) for data in file_bytes(0, args.files, args.seed).values()) + (args.size_mb << 20)
    print(
        f"\n{args.size_mb} MiB in {args.files} files{' (Xet)' if args.xet else ''}, latency {args.latency_ms:g} ms, "
        f"pieces {args.piece_mb} MiB, {args.shards_at_once} place(s) per file at once, work {args.work}; "
        f"{platform.node()}, {os.cpu_count()} CPUs\n"
    )
    print("| link MB/s | step | seconds | MB/s | peak RssAnon MB | fetched again MB | retries |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        stats = row.get("stats", {})
        print(
            f"| {row['bandwidth']:g} | {row['step']} | {row['seconds']:.2f} | {size / row['seconds'] / 1e6:.0f} | "
            f"{row['peak_anon_mb']:.0f} | {stats.get('fetched_again', 0) / 1e6:.1f} | {stats.get('retries', '')} |"
        )
    by = {(row["bandwidth"], row["step"]): row["seconds"] for row in rows}
    for bandwidth in sorted({row["bandwidth"] for row in rows}):
        parts = [by.get((bandwidth, s)) for s in ("download", "local", "stream+work")]
        if None not in parts:
            print(
                f"\nlink {bandwidth:g} MB/s: stream+work / max(download, local) = "
                f"{parts[2] / max(parts[0], parts[1]):.2f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
