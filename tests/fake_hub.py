"""A local stand-in of the Hub's upload API on 127.0.0.1, for the real huggingface_hub and hf_xet clients.

It speaks as much of the Hub's API as an upload uses (found by logging what the clients ask): repo create and
info, branch create, the file listing, README validation, preupload, the Xet write token, the commit (files added
and deleted); and of the Xet storage (CAS) API: the global dedup query (answered "not found"), xorb upload grants
(answered "not offered", so the client posts xorbs directly), xorbs and shards; and Git LFS's batch API and PUT,
for huggingface_hub without hf_xet.
It rebuilds every file it is given, from base64 in the commit, from the xorbs' chunks through the shard's file
segments, or from the LFS object, checks each against the sha256 the commit names, and keeps each branch's
files, so a test can compare what the server holds with a folder, byte for byte.

Xorb chunks must come uncompressed (HF_XET_XORB_COMPRESSION_POLICY=none): LZ4 is the storage's business, and
the stand-in refuses a compressed chunk rather than guess. ``serve()`` stops the server by itself after
``lifetime`` seconds, whatever the test does.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

WRITE_TOKEN, READ_TOKEN, XET_TOKEN = "hf_write_token", "hf_read_token", "xet_access_token"
ROOT = Path(__file__).resolve().parents[1]
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def xet_hex(raw: bytes) -> str:
    """Xet writes a 32-byte hash as four little-endian u64s and prints each as 16 hex digits."""
    return "".join(f"{word:016x}" for word in struct.unpack("<4Q", raw))


def xorb_chunks(xorb: bytes) -> list[bytes]:
    """The chunks of an uploaded xorb: each has an 8-byte header (version 0, compressed length u24, compression
    scheme, uncompressed length u24); whatever follows the last one starts with a non-zero byte (footer)."""
    chunks, pos = [], 0
    while pos + 8 <= len(xorb) and xorb[pos] == 0:
        stored = int.from_bytes(xorb[pos + 1 : pos + 4], "little")
        scheme = xorb[pos + 4]
        size = int.from_bytes(xorb[pos + 5 : pos + 8], "little")
        if scheme != 0 or stored != size:
            raise ValueError(f"compressed chunk (scheme {scheme}): set HF_XET_XORB_COMPRESSION_POLICY=none")
        chunks.append(xorb[pos + 8 : pos + 8 + size])
        pos += 8 + size
    return chunks


def shard_files(shard: bytes) -> list[tuple[str, list[tuple[str, int, int]]]]:
    """(sha256, [(xorb hash, first chunk, end chunk)]) per file of a Xet shard: a 48-byte header (tag, version,
    footer size), then per file a 48-byte header (file hash, flags, entry count), its 48-byte segment entries,
    verification entries when flag bit 31 is set, a metadata entry holding the sha256 when bit 30 is; the file
    section ends with a header whose hash is all ones."""
    assert shard[:14] == b"HFRepoMetaData", "not a Xet shard"
    pos, files = 48, []
    while True:
        file_hash, flags, count = struct.unpack_from("<32sII", shard, pos)
        pos += 48
        if file_hash == b"\xff" * 32:
            return files
        segments = []
        for _ in range(count):
            xorb_hash, _, _, start, end = struct.unpack_from("<32sIIII", shard, pos)
            segments.append((xet_hex(xorb_hash), start, end))
            pos += 48
        if flags & (1 << 31):
            pos += 48 * count
        assert flags & (1 << 30), "a shard file entry without its sha256"
        files.append((xet_hex(shard[pos : pos + 32]), segments))
        pos += 48


class Hub:
    """What the stand-in holds: repos with branches of files, and the uploaded objects by sha256. Every API
    request needs a token (WRITE_TOKEN, or READ_TOKEN for reads); the Xet storage takes the Xet token."""

    def __init__(self):
        self.lock = threading.Lock()
        self.repos: dict[str, dict] = {}
        self.xorbs: dict[str, bytes] = {}
        self.objects: dict[str, bytes] = {}  # sha256 -> bytes, from xet shards or LFS PUTs
        self.requests: list[str] = []
        self.commits: list[dict] = []
        self.cas_url: str | None = None  # where the Xet token sends the client; None: this server's /cas

    def add_repo(self, repo_id, *, private):
        self.repos[repo_id] = {"private": private, "branches": {"main": {".gitattributes": GITATTRIBUTES}}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # hf_xet (reqwest) keeps connections alive
    timeout = 20  # a stuck client cannot hold a server thread for long
    hub: Hub

    def log_message(self, *args):
        pass

    # -- plumbing ------------------------------------------------------------------------------------------
    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while (size := int(self.rfile.readline().split(b";")[0].strip(), 16)) > 0:
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
            return body
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status, body=b"", content_type="application/json", headers=None):
        body = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":  # a HEAD answer has no body, or the next answer on the connection is garbled
            self.wfile.write(body)

    def _error(self, status, message, code=None):
        headers = {"X-Error-Message": message, **({"X-Error-Code": code} if code else {})}
        self._send(status, {"error": message}, headers=headers)

    def _token(self):
        auth = self.headers.get("Authorization", "")
        return auth[len("Bearer ") :] if auth.startswith("Bearer ") else None

    def _handle(self):
        body = self._read_body()
        url = urlsplit(self.path)
        path = unquote(url.path)
        with self.hub.lock:
            self.hub.requests.append(f"{self.command} {path}")
        endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        try:
            self._route(path, body, endpoint)
        except (BrokenPipeError, ConnectionResetError):
            pass

    do_GET = do_POST = do_PUT = do_HEAD = _handle

    # -- the routes ------------------------------------------------------------------------------------------
    def _route(self, path, body, endpoint):
        hub = self.hub
        if path == "/api/agent-harnesses":
            return self._send(404, {"error": "not served here"})
        if path == "/v1/telemetry":  # hf_xet's upload summary
            return self._send(200, {})
        if path.startswith("/cas/"):
            return self._cas(path[len("/cas") :], body)
        if path.startswith("/lfs-objects/"):
            return self._lfs_put(path.rsplit("/", 1)[1], body)

        token = self._token()
        if token not in (WRITE_TOKEN, READ_TOKEN):
            return self._error(401, "Invalid credentials in Authorization header")
        writes = self.command in ("POST", "PUT") and path != "/api/validate-yaml"
        if writes and token != WRITE_TOKEN:
            return self._error(403, "You don't have the rights to write to this repository: the token is read-only")

        if path == "/api/validate-yaml":
            return self._validate_yaml(json.loads(body)["content"])
        if path == "/api/repos/create":
            request = json.loads(body)
            repo_id = f"{request['organization']}/{request['name']}"
            if repo_id in hub.repos:
                return self._send(409, {"error": "You already created this model repo", "url": f"{endpoint}/{repo_id}"})
            hub.add_repo(repo_id, private=request.get("visibility") == "private" or request.get("private") is True)
            return self._send(200, {"url": f"{endpoint}/{repo_id}", "name": repo_id})

        if path.endswith(".git/info/lfs/objects/batch"):
            return self._lfs_batch(json.loads(body), endpoint)
        if "/resolve/" in path:  # /<org>/<name>/resolve/<revision>/<file>: a download
            return self._resolve(*path.lstrip("/").split("/resolve/", 1))
        parts = path.split("/")  # /api/models/<org>/<name>/<action>/<rest...>
        if len(parts) < 5 or parts[:3] != ["", "api", "models"]:
            return self._error(404, "Sorry, we can't find the page you are looking for.")
        repo_id, action, rest = f"{parts[3]}/{parts[4]}", (parts[5:6] or [""])[0], "/".join(parts[6:])
        repo = hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "Repository not found", "RepoNotFound")
        if action in ("", "revision"):
            branch = repo["branches"].get(rest or "main")
            if branch is None:
                return self._error(404, f"Invalid rev id: {rest}", "RevisionNotFound")
            sha = hashlib.sha1(json.dumps(sorted(branch)).encode()).hexdigest()
            return self._send(
                200,
                {
                    "id": repo_id,
                    "private": repo["private"],
                    "sha": sha,
                    "siblings": [{"rfilename": name} for name in branch],
                },
            )
        if action == "tree":  # /tree/<revision>: the listing that list_repo_files (and delete_patterns) read
            branch = repo["branches"].get(rest or "main")
            if branch is None:
                return self._error(404, f"Invalid rev id: {rest}", "RevisionNotFound")
            return self._send(
                200,
                [
                    {"type": "file", "path": name, "size": len(data), "oid": git_blob_sha1(data)}
                    for name, data in sorted(branch.items())
                ],
            )
        if action == "branch":
            if rest in repo["branches"]:
                return self._error(409, "Reference already exists")
            repo["branches"][rest] = dict(repo["branches"]["main"])
            return self._send(200, {})
        branch = repo["branches"].get(rest)
        if action in ("preupload", "xet-write-token", "commit") and branch is None:
            return self._error(404, f"Invalid rev id: {rest}", "RevisionNotFound")
        if action == "preupload":
            return self._send(200, {"files": [self._upload_mode(entry, branch) for entry in json.loads(body)["files"]]})
        if action == "xet-write-token":
            expiry = str(int(time.time()) + 3600)
            info = {"casUrl": self.hub.cas_url or f"{endpoint}/cas", "accessToken": XET_TOKEN, "exp": int(expiry)}
            headers = {
                "X-Xet-Cas-Url": info["casUrl"],
                "X-Xet-Access-Token": XET_TOKEN,
                "X-Xet-Token-Expiration": expiry,
            }
            return self._send(200, info, headers=headers)
        if action == "commit":
            return self._commit(repo_id, rest, branch, body, endpoint)
        return self._error(404, f"no route for {path}")

    def _resolve(self, repo_id, revision_and_file):
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "Repository not found", "RepoNotFound")
        revision, _, name = revision_and_file.partition("/")
        if revision not in repo["branches"]:
            return self._error(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        if name not in repo["branches"][revision]:
            return self._error(404, "Entry not found", "EntryNotFound")
        data = repo["branches"][revision][name]
        etag = f'"{git_blob_sha1(data)}"'
        headers = {"ETag": etag, "X-Repo-Commit": "0" * 40}
        return self._send(200, data, content_type="application/octet-stream", headers=headers)

    def _validate_yaml(self, content):
        from huggingface_hub import ModelCard

        try:
            ModelCard(content)  # the Hub refuses a README whose front matter does not parse
        except Exception as error:  # noqa: BLE001
            return self._send(400, {"errors": [{"message": str(error)}], "error": "Invalid metadata"})
        return self._send(200, {"errors": [], "warnings": []})

    def _upload_mode(self, entry, branch):
        current = branch.get(entry["path"])
        lfs = entry["path"].endswith(".safetensors")  # as .gitattributes says
        oid = None if current is None else hashlib.sha256(current).hexdigest() if lfs else git_blob_sha1(current)
        return {"path": entry["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid}

    def _commit(self, repo_id, revision, branch, body, endpoint):
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        assert lines[0]["key"] == "header"
        changes, transports = {}, {}
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                changes[value["path"]] = base64.b64decode(value["content"])
                transports[value["path"]] = "inline"
            elif line["key"] == "lfsFile":
                data = self.hub.objects.get(value["oid"])
                if data is None or len(data) != value["size"]:
                    return self._error(422, f"{value['path']} points to an object that was never uploaded")
                changes[value["path"]] = data
                transports[value["path"]] = "object"
            elif line["key"] == "deletedFile":
                if value["path"] not in branch:
                    return self._error(404, f"{value['path']} does not exist in the branch")
                changes[value["path"]] = None
                transports[value["path"]] = "deleted"
            else:
                return self._error(400, f"unexpected commit operation {line['key']}")
        with self.hub.lock:
            for path, data in changes.items():
                if data is None:
                    del branch[path]
                else:
                    branch[path] = data
            oid = hashlib.sha1(f"{repo_id}{revision}{len(self.hub.commits)}".encode()).hexdigest()
            self.hub.commits.append({"repo": repo_id, "revision": revision, "files": transports})
        commit_url = f"{endpoint}/{repo_id}/commit/{oid}"
        return self._send(200, {"commitUrl": commit_url, "commitOid": oid, "pullRequestUrl": None})

    def _cas(self, path, body):
        if self._token() != XET_TOKEN:
            return self._send(401, b"bad xet token", content_type="text/plain")
        if path.startswith("/v1/chunks/"):  # global dedup: nothing stored elsewhere
            return self._send(404, b"", content_type="text/plain")
        if path.startswith("/v1/xorb-grants/"):  # upload grants not offered: the client posts the xorb itself
            return self._send(404, b"", content_type="text/plain")
        if path.startswith("/v1/xorbs/"):
            try:
                xorb_chunks(body)
            except ValueError as error:
                return self._send(400, str(error).encode(), content_type="text/plain")
            with self.hub.lock:
                self.hub.xorbs[path.rsplit("/", 1)[1]] = body
            return self._send(200, {"was_inserted": True})
        if path in ("/v2/shards", "/v1/shards"):
            with self.hub.lock:
                for sha256, segments in shard_files(body):
                    chunks = [xorb_chunks(self.hub.xorbs[xorb])[first:end] for xorb, first, end in segments]
                    data = b"".join(b"".join(part) for part in chunks)
                    if hashlib.sha256(data).hexdigest() != sha256:
                        return self._send(400, b"a file's segments do not match its sha256", content_type="text/plain")
                    self.hub.objects[sha256] = data
            if path == "/v1/shards":
                return self._send(200, {"result": 1})
            return self._send(200, b'{"type":"result"}\n', content_type="application/x-ndjson")
        return self._send(404, b"no such CAS route", content_type="text/plain")

    def _lfs_batch(self, request, endpoint):
        assert request["operation"] == "upload" and "basic" in request["transfers"]
        objects = []
        for item in request["objects"]:
            entry = {"oid": item["oid"], "size": item["size"]}
            if item["oid"] not in self.hub.objects:
                entry["actions"] = {"upload": {"href": f"{endpoint}/lfs-objects/{item['oid']}", "header": {}}}
            objects.append(entry)
        return self._send(200, {"transfer": "basic", "objects": objects}, content_type="application/vnd.git-lfs+json")

    def _lfs_put(self, oid, body):
        if hashlib.sha256(body).hexdigest() != oid:
            return self._send(400, b"sha256 mismatch", content_type="text/plain")
        with self.hub.lock:
            self.hub.objects[oid] = body
        return self._send(200, b"", content_type="text/plain")


@contextlib.contextmanager
def serve(lifetime: float = 120):
    """(endpoint URL, Hub state) of a stand-in served on 127.0.0.1 for the duration of the block."""
    state = Hub()
    handler = type("BoundHandler", (Handler,), {"hub": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    watchdog = threading.Timer(lifetime, server.shutdown)  # stops by itself if a test hangs
    watchdog.daemon = True
    watchdog.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        watchdog.cancel()
        server.shutdown()
        server.server_close()


def client_env(endpoint: str, home: Path, **settings: str) -> dict[str, str]:
    """The environment of a subprocess that talks to ``endpoint`` (huggingface_hub reads it at import), with
    its own HF_HOME (nothing read from or written to the user's cache or login), nf4convert from this tree."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", **settings)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
