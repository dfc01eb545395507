"""The real huggingface_hub client against a small local endpoint that serves a repo the Hub's way.

HF_ENDPOINT, HF_HUB_OFFLINE and HF_HUB_CACHE are read when huggingface_hub is imported, so each
case runs the CLI in a subprocess with its own environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from checkpoints import build

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "test-org/tiny-llama-bnb-4bit"
GATED = "test-org/gated-bnb-4bit"


class FakeHub(BaseHTTPRequestHandler):
    files: dict[str, bytes] = {}
    requested: list[str] = []

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status, body=b"", headers=None, head=False):
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, payload):
        self._send(200, json.dumps(payload).encode(), {"Content-Type": "application/json"})

    def _route(self, head):
        path = unquote(urlparse(self.path).path)
        self.requested.append(f"{self.command} {path}")
        for repo in (REPO, GATED):
            if path.startswith((f"/api/models/{repo}/", f"/{repo}/")) and repo == GATED:
                return self._send(401, b"gated", {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to this repo is restricted"}, head)
        if path.startswith(f"/api/models/{REPO}/revision/"):
            return self._json({"id": REPO, "modelId": REPO, "sha": COMMIT, "siblings": [{"rfilename": f} for f in self.files]})
        if path.startswith(f"/api/models/{REPO}/tree/"):
            return self._json([{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()} for f, d in self.files.items()])
        prefix = f"/{REPO}/resolve/"
        if path.startswith(prefix):
            name = path[len(prefix) :].split("/", 1)[1]
            if name in self.files:
                data = self.files[name]
                etag = f'"{hashlib.sha256(data).hexdigest()}"'
                return self._send(200, data, {"X-Repo-Commit": COMMIT, "ETag": etag, "Content-Type": "application/octet-stream"}, head)
            return self._send(404, b"no entry", {"X-Error-Code": "EntryNotFound"}, head)
        return self._send(404, b"not found", {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, head)

    def do_GET(self):
        self._route(head=False)

    def do_HEAD(self):
        self._route(head=True)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    source = build(tmp_path_factory.mktemp("hubrepo") / "repo", "llama-nf4-dq")
    files = {p.relative_to(source).as_posix(): p.read_bytes() for p in source.rglob("*") if p.is_file()}
    files["pytorch_model.bin"] = b"old weights that must not be downloaded"
    files["original/consolidated.pth"] = b"neither these"
    FakeHub.files = files
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", source
    server.shutdown()


def cli(*args, env, cwd):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), full_env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "nf4convert.cli", *map(str, args)], capture_output=True, text=True,
                          env=full_env, cwd=cwd, timeout=600)  # fmt: skip


def test_download_convert_then_offline(hub, tmp_path):
    endpoint, source = hub
    cache = tmp_path / "cache"
    FakeHub.requested.clear()
    result = cli(REPO, "-q", "--cache-dir", cache, env={"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1"}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "tiny-llama-bf16"
    assert (out / "model.safetensors").exists() and (out / "tokenizer_config.json").exists()
    fetched = [r.split(" ", 1)[1] for r in FakeHub.requested if r.startswith("GET") and "/resolve/" in r]
    assert fetched and not [f for f in fetched if f.endswith((".bin", ".pth"))]  # only what conversion needs

    # Offline, from the cache alone (the endpoint is not even reachable).
    verify = cli("verify", out, REPO, "--cache-dir", cache, env={"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}, cwd=tmp_path)
    assert verify.returncode == 0 and "OK: bit-exact" in verify.stdout, verify.stderr
    again = cli(REPO, "-q", "-o", "offline-out", "--cache-dir", cache, env={"HF_HUB_OFFLINE": "1"}, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "offline-out" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


@pytest.mark.parametrize("repo,env,message", [
    ("test-org/missing-bnb-4bit", {}, "repository not found on the Hub"),
    (GATED, {}, "gated repository"),
    (REPO, {"HF_HUB_OFFLINE": "1"}, "not in the Hub cache"),
])  # fmt: skip
def test_hub_errors_are_one_line(hub, tmp_path, repo, env, message):
    endpoint, _ = hub
    result = cli(repo, "-q", "--cache-dir", tmp_path / "empty-cache", env={"HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_XET": "1", **env}, cwd=tmp_path)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip() and "kernels-community" not in line]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], result.stderr
