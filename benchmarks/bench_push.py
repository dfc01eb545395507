"""Hub to Hub with bounded disk (``--push-to-hub REPO --no-local-copy``) beside today's download, convert, then upload:
wall time, peak host memory and the most local disk held, at a few link speeds.

    python benchmarks/bench_push.py [--layers 4] [--vocab 32000] [--device cpu] [--bandwidths 100,500,0]
                                    [--steps download,convert,upload,sequential,streamed] [--workdir DIR] [--json FILE]

The server is tests/fixtures/fake_hub.py in a process of its own (bench_hub_stream.py's ``--serve``): a
Llama-8B-shaped bitsandbytes 4-bit checkpoint of ``--layers`` layers (bench_convert.build_source) published on it, its
CDN a link of ``--bandwidths`` MB/s (0: unlimited) shared by every download, and LFS uploads a link of the same speed
in the other direction (HTTP LFS: the stand-in's Xet store is not paced, so Xet is off for every step). For each
speed, each step a command line in a fresh process with an empty Hub cache:

  download    huggingface_hub's snapshot_download of the source repo (the download alone)
  convert     nf4convert of the local folder (the conversion alone; measured once)
  upload      push_to_hub of that conversion's folder (the upload alone)
  sequential  nf4convert REPO --download --push-to-hub: today's route, the download, the conversion, then the upload
  streamed    nf4convert REPO --push-to-hub --no-local-copy: the source streamed, each shard uploaded as it is made

with wall time, peak RssAnon, and the most disk the Hub cache, TMPDIR and the output held at once. The figure of
merit: streamed / max(download, convert, upload), which the mode aims to keep at or under 1.1. The streamed repo's
files are compared by sha256 with the local conversion's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_REPO = "bench/stream-bnb-4bit"  # what bench_hub_stream.py's --serve publishes
UPLOAD = (
    "import sys; from nf4convert.hub.upload import push_to_hub; push_to_hub(sys.argv[1], sys.argv[2], progress=False)"
)
DOWNLOAD = "import sys; from huggingface_hub import snapshot_download; snapshot_download(sys.argv[1])"
REPO_DIGESTS = (
    "import json, sys; from huggingface_hub import HfApi; "
    "print(json.dumps({f.path: f.lfs.sha256 for f in HfApi().list_repo_tree(sys.argv[1], expand=True) "
    "if getattr(f, 'lfs', None) and f.path.endswith('.safetensors')}))"
)


def digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.file_digest(open(p, "rb"), "sha256").hexdigest()  # noqa: SIM115
        for p in sorted(folder.glob("*.safetensors"))
    }


def run_step(name, number, bandwidth, source, local, reference, cli, workdir, args) -> dict:
    """One step on a server of its own: the Hub holds none of an earlier step's uploads, so nothing is skipped as
    already there."""
    from bench_convert import measure
    from bench_hub_stream import DiskPeak

    from fixtures.fake_hub import WRITE_TOKEN

    server_command = [sys.executable, str(ROOT / "benchmarks" / "bench_hub_stream.py"), "--serve"]
    server_command += ["--folder", str(source), "--bandwidth", str(bandwidth), "--upload-bandwidth", str(bandwidth)]
    with subprocess.Popen(server_command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as server:
        ready = json.loads(server.stdout.readline())
        env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
        env.update(HF_ENDPOINT=ready["endpoint"], HF_TOKEN=WRITE_TOKEN, HF_HUB_DISABLE_TELEMETRY="1")
        env.update(HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        out, target = workdir / "out", f"bench/{name}-{number}"
        commands = {
            "download": [sys.executable, "-c", DOWNLOAD, SOURCE_REPO],
            "upload": [sys.executable, "-c", UPLOAD, str(local), target],
            "sequential": [*cli, SOURCE_REPO, "--download", "-o", str(out), "--push-to-hub", target],
            "streamed": [*cli, SOURCE_REPO, "--push-to-hub", target, "--no-local-copy"],
        }
        home, tmp, cwd = workdir / "home", workdir / "tmp", workdir / "run"
        for folder in (home, tmp, out, cwd):
            shutil.rmtree(folder, ignore_errors=True)
        tmp.mkdir()
        cwd.mkdir()  # where a run with no -o stages its shards
        subprocess.run(["sync"], check=True)
        disk = DiskPeak([home, tmp, out, cwd])
        try:
            row = measure(commands[name], env={**env, "HF_HOME": str(home), "TMPDIR": str(tmp)}, cwd=str(cwd))
        finally:
            row["disk_mb"] = disk.stop() / 1e6
        row.update(step=name, bandwidth=bandwidth)
        if name in ("streamed", "sequential") and reference is not None:
            listed = subprocess.run(
                [sys.executable, "-c", REPO_DIGESTS, target], env=env, capture_output=True, text=True, check=True
            )
            row["same_bytes"] = json.loads(listed.stdout) == reference
        shutil.rmtree(out, ignore_errors=True)
        server.stdin.close()
        server.wait(timeout=60)
    print(f"{bandwidth:g} MB/s {name}: {json.dumps(row)}", file=sys.stderr, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bandwidths", default="100,500,0", help="MB/s of each link, 0: unlimited")
    parser.add_argument("--steps", default="download,convert,upload,sequential,streamed")
    parser.add_argument("--max-shard-size", default="1GB")
    parser.add_argument("--workdir", help="where the checkpoint is built (kept)")
    parser.add_argument("--json")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests"))
    from bench_convert import build_source, measure

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-push-"))
    source = workdir / "stream-bnb-4bit"
    if not (source / "config.json").is_file():
        shutil.rmtree(source, ignore_errors=True)
        build_source(source, args.layers, vocab_size=args.vocab)
    size = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    cli = [sys.executable, "-m", "nf4convert", "-q", "--device", args.device, "--max-shard-size", args.max_shard_size]
    local, rows, reference = workdir / "local-out", [], None
    steps = args.steps.split(",")
    try:
        if "convert" in steps or "upload" in steps:
            shutil.rmtree(local, ignore_errors=True)
            row = measure([*cli, str(source), "-o", str(local)])
            row.update(step="convert", bandwidth=None)
            rows.append(row)
            reference = digests(local)
            print(f"convert: {json.dumps(row)}", file=sys.stderr, flush=True)
        out_bytes = sum(p.stat().st_size for p in local.glob("*.safetensors")) if local.is_dir() else 0
        for number, bandwidth in enumerate(float(b) for b in args.bandwidths.split(",")):
            for name in (step for step in steps if step != "convert"):
                rows.append(run_step(name, number, bandwidth, source, local, reference, cli, workdir, args))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"\n{args.layers}-layer Llama-8B-shaped bnb-4bit checkpoint, {size / 1e9:.2f} GB in, {out_bytes / 1e9:.2f} GB "
        f"out (shards of {args.max_shard_size}), --device {args.device}; {platform.node()}, {os.cpu_count()} CPUs\n"
    )
    print("| link MB/s | step | seconds | peak RssAnon MB | disk MB | same bytes |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        link = "-" if row["bandwidth"] is None else f"{row['bandwidth']:g}"
        print(
            f"| {link} | {row['step']} | {row['seconds']:.2f} | {row['peak_anon_mb']:.0f} | "
            f"{row.get('disk_mb', 0):.0f} | {row.get('same_bytes', '')} |"
        )
    by = {(row["bandwidth"], row["step"]): row["seconds"] for row in rows}
    convert = by.get((None, "convert"))
    for bandwidth in sorted({row["bandwidth"] for row in rows if row["bandwidth"] is not None}):
        parts = [by.get((bandwidth, step)) for step in ("download", "upload", "sequential", "streamed")]
        if None not in parts and convert:
            longest = max(parts[0], convert, parts[1])
            print(
                f"\nlink {bandwidth:g} MB/s: streamed / max(download, convert, upload) = {parts[3] / longest:.2f}; "
                f"sequential / streamed = {parts[2] / parts[3]:.2f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
