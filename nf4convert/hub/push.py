"""Push straight to the Hub with no local copy (``--no-local-copy``): each large file of the output preuploaded as soon
as it is complete, then removed, and everything committed in one commit at the end.

huggingface_hub has the parts: ``preupload_lfs_files`` sends a file's content (hf_xet's chunks, or Git LFS with its
multipart parts, each retried with backoff) without committing it, and ``create_commit`` commits operations whose
content is uploaded already. So the repo never shows a half-made model: until the one commit, nothing of the run is
in it. One commit holds every file (huggingface_hub splits no commit; the Hub takes thousands of operations in one).

A run keeps a record of what it uploaded (``Record``: each file's sha256, size and first bytes, as a commit needs
them), written after each upload and keyed by the plan and the source it was made from: a run stopped by a lost
network, Ctrl-C or a kill leaves the repo as it was, and the same command run again asks the Hub which of the
recorded objects it holds (the LFS batch endpoint, as a preupload asks it) and makes only the others. The record goes
once the commit is made.

At most ``on_disk`` large files are on the local disk at once: the sink waits in ``finished`` until the upload of the
one before is done.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from ..errors import Interrupted, Nf4ConvertError, Terminated, UploadError
from .download import progress_bars
from .errors import hub_error_line
from .session import hub_session
from .upload import DEFAULT_COMMIT_MESSAGE, REPLACED_FILES, check_target, check_writable

ATTEMPTS = 4  # a preupload or a commit tried this many times (huggingface_hub retries each LFS part within each)
FIRST_WAIT = 1.0  # seconds before the first retry, doubled for each next one
SMALL_BYTES = 10 << 20  # files left at the end smaller than this go inline in the commit, as the Hub takes them
KEPT = (".gitattributes",)  # a repo holding only these is as good as empty


def record_folder() -> Path:
    """Where the records of pushes under way are kept: the user's cache (XDG_CACHE_HOME, else ~/.cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "nf4convert" / "pushes"


@dataclass
class Record:
    """The files a push has uploaded (not committed), by their path in the repo: ``{"sha256", "size", "sample"}``."""

    path: Path
    key: str
    files: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path, key: str) -> "Record":
        """The record at ``path`` if it is of this plan (``key``), else a new one."""
        try:
            held = json.loads(path.read_text())
            if held.get("key") == key and isinstance(held.get("files"), dict):
                return cls(path, key, held["files"])
        except (OSError, ValueError):
            pass
        return cls(path, key)

    def add(self, name: str, sha256: str, size: int, sample: bytes) -> None:
        self.files[name] = {"sha256": sha256, "size": size, "sample": base64.b64encode(sample).decode()}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        temporary.write_text(json.dumps({"key": self.key, "files": self.files}, indent=1))
        os.replace(temporary, self.path)  # a kill leaves the old record or the new one, never half of one

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


def plan_key(plan, *, source: str, revision: str | None, commits: list, adapter_folder: Path | None) -> str:
    """What a recorded file was made from: the source as named and where it was read (the Hub commits, or each local
    weight file's size and time), the adapter's files, and every output tensor's place and kind."""
    from .. import __version__

    if commits:
        origin = sorted(commits)
    else:
        paths = sorted({info.path for info in plan.source_tensors.values()})
        origin = [[path.name, path.stat().st_size, path.stat().st_mtime_ns] for path in paths]
    adapter = []
    if adapter_folder is not None:
        adapter = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(adapter_folder.iterdir())]
    layout = [
        [shard.filename, [[t.name, t.dtype, list(t.shape), t.offset, type(t.recipe).__name__] for t in shard.tensors]]
        for shard in plan.shards
    ]
    described = [__version__, source, revision, origin, adapter, plan.dtype.name, layout]
    return hashlib.sha256(json.dumps(described, default=str).encode()).hexdigest()


@dataclass
class Pushed:
    """What a push without a local copy did."""

    url: str
    uploaded: list[tuple[str, int]] = field(default_factory=list)  # (path in the repo, bytes) sent by this run
    found: list[tuple[str, int]] = field(default_factory=list)  # recorded files the Hub held already: not made
    committed: int = 0  # files in the commit


class HubPush:
    """One push straight to the Hub: ``open`` (before any work: the Hub reachable, the token valid, the repo's
    state), ``start`` (the record of this plan, and which of its files the Hub holds), then the sink's ``Delivery``
    (``on_disk``, ``wanted``, ``finished``), then ``commit``."""

    def __init__(self, repo_id: str, *, private=False, token=None, branch=None, overwrite=False, progress=True,
                 on_disk: int = 2, again: str | None = None):  # fmt: skip
        check_target(repo_id, branch)
        self.repo_id, self.private, self.token, self.branch = repo_id, private, token, branch
        self.overwrite, self.progress, self.on_disk, self.again = overwrite, progress, max(1, on_disk), again
        self.api = None
        self.exists = False  # the repo (and the branch) are there
        self.repo_files: list[str] = []
        self.record: Record | None = None
        self.pushed = Pushed("")
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Condition()
        self._pending = 0  # files handed over and not yet removed
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.sent = 0  # bytes uploaded so far
        self.inline: dict[str, bytes] = {}  # files the Hub takes inline (not LFS): in the commit itself
        self.check = None  # ``check(path)`` of each finished file before it is uploaded (verify's), or None

    # -- before any work -------------------------------------------------------------------------------------------
    def _session(self):
        return _Both(progress_bars(False), hub_session(quiet=not self.progress))

    def open(self) -> None:
        """UploadError unless the Hub answers, the token is valid, and the repo may take this push: a public repo for
        ``private``, or one holding files already (beyond .gitattributes) without ``overwrite``, are refused."""
        from huggingface_hub import HfApi
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        self.api = HfApi(token=self.token)
        with self._failing("cannot be pushed to"), self._session():
            check_writable(self.api.whoami(), self.repo_id)
            try:
                info = self.api.repo_info(self.repo_id)
            except RepositoryNotFoundError:
                return
            self.exists = True
            if self.private and not info.private:
                raise UploadError(
                    f"{self.repo_id}: the repository exists and is public; nothing was uploaded (make it private "
                    "on the Hub first, or push without --private)",
                    option="private",
                )
            try:
                self.repo_files = self.api.list_repo_files(self.repo_id, revision=self.branch)
            except RevisionNotFoundError:
                self.exists = False  # the branch is made from the default branch, whose files it then holds
                self.repo_files = self.api.list_repo_files(self.repo_id)
        held = [name for name in self.repo_files if name not in KEPT]
        if held and not self.overwrite:
            shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
            raise UploadError(
                f"{self.repo_id}: the repository holds files already ({shown}); pass --overwrite to replace its "
                "weights with this output",
                option="overwrite",
            )

    def start(self, plan, source: str, revision: str | None, weights, adapter_folder: Path | None) -> None:
        """The record of this plan (``plan_key``: of ``source`` at ``revision`` as ``weights`` read it, and the
        adapter's files), the recorded files the Hub does not hold dropped from it."""
        from huggingface_hub.lfs import UploadInfo, post_lfs_batch_info

        commits = [[remote.repo_id, remote.commit] for remote in weights.opened]
        key = plan_key(plan, source=source, revision=revision, commits=commits, adapter_folder=adapter_folder)
        name = f"{self.repo_id.replace('/', '--')}--{quote(self.branch or 'main', safe='')}.json"
        self.record = Record.load(record_folder() / name, key)
        if not self.record.files:
            return
        held = set()
        if self.exists:
            infos = [_info(entry, UploadInfo) for entry in self.record.files.values()]
            with self._failing("could not be asked what it holds"), self._session():
                actions, _, _ = self._retried(
                    lambda: post_lfs_batch_info(
                        upload_infos=infos,
                        token=self.token,
                        repo_type="model",
                        repo_id=self.repo_id,
                        revision=self.branch,
                        endpoint=self.api.endpoint,
                    )
                )
            held = {action["oid"] for action in actions if not action.get("actions")}
        for name in list(self.record.files):
            if self.record.files[name]["sha256"] not in held:
                del self.record.files[name]
        self.pushed.found = [(name, entry["size"]) for name, entry in self.record.files.items()]

    # -- the sink's Delivery ---------------------------------------------------------------------------------------
    def wanted(self, name: str) -> bool:
        return self.record is None or name not in self.record.files

    def finished(self, path: Path) -> None:
        """Hand ``path`` to the uploading thread; wait until at most ``on_disk - 1`` files are on disk besides the one
        the sink writes next. The uploading thread's failure is raised here."""
        if self.check is not None:
            try:
                self.check(path)
            except Nf4ConvertError as error:  # a mismatch: the same command would meet it again
                raise type(error)(f"{error}; nothing further was uploaded and nothing was committed") from None
        if self._thread is None:
            self._thread = threading.Thread(target=self._uploading, name="nf4convert-upload", daemon=True)
            self._thread.start()
        with self._lock:
            self._raise_failure()
            self._pending += 1
            self._queue.put(path)
            while self._pending > self.on_disk - 1 and self._failure is None:
                self._lock.wait(0.5)
            self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _uploading(self) -> None:
        while (path := self._queue.get()) is not None:
            try:
                if self._failure is None:
                    self._upload(path, path.name)
            except BaseException as error:  # noqa: BLE001  (raised on the sink's thread, in ``finished``)
                with self._lock:
                    self._failure = error
                    self._lock.notify_all()
            finally:
                with contextlib.suppress(OSError):
                    path.unlink()
                with self._lock:
                    self._pending -= 1
                    self._lock.notify_all()

    def _upload(self, path: Path, name: str) -> None:
        """Preupload ``path`` as ``name`` (retried), record it, count it."""
        from huggingface_hub import CommitOperationAdd

        self._ensure_repo()
        size = path.stat().st_size
        with self._failing("upload failed"), self._session():
            operation = CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path))
            self._retried(
                lambda: self.api.preupload_lfs_files(
                    self.repo_id, additions=[operation], revision=self.branch, free_memory=True
                )
            )
        if operation._upload_mode != "lfs":  # the Hub takes it inline: kept in memory for the commit
            self.inline[name] = path.read_bytes()
            return
        info = operation.upload_info
        self.record.add(name, info.sha256.hex(), info.size, info.sample)
        self.pushed.uploaded.append((name, size))
        self.sent += size

    def _ensure_repo(self) -> None:
        """The repo and the branch made, on the first upload (a run that fails before one leaves the Hub as it was)."""
        if self.exists:
            return
        with self._failing("cannot be created"), self._session():
            self.api.create_repo(self.repo_id, private=self.private, exist_ok=True)
            if self.branch is not None and not self.branch.startswith("refs/"):
                self.api.create_branch(self.repo_id, branch=self.branch, exist_ok=True)
        self.exists = True

    # -- the end ---------------------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Until every file handed over is uploaded and removed; the uploads' failure raised."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._raise_failure()

    def commit(self, files: dict[str, Path | bytes], *, replace_weights: bool = True) -> Pushed:
        """Wait for the uploads, upload ``files`` (what is left: side files, a one-file output; the large ones
        preuploaded and recorded first), then commit them with every uploaded file in one commit, deleting the repo's
        root weight files the output lacks (``upload.REPLACED_FILES``) unless not ``replace_weights`` (a GGUF sits
        beside other weights). The record goes once committed."""
        from fnmatch import fnmatchcase

        from huggingface_hub import CommitOperationAdd, CommitOperationDelete
        from huggingface_hub.lfs import UploadInfo

        self.wait()
        for name, content in list(files.items()):
            if isinstance(content, Path) and content.stat().st_size >= SMALL_BYTES:
                self._upload(content, name)
                del files[name]
        self._ensure_repo()
        operations = []
        for name, entry in self.record.files.items():
            operation = CommitOperationAdd(path_in_repo=name, path_or_fileobj=b"")
            operation.upload_info = _info(entry, UploadInfo)
            operation._upload_mode, operation._is_uploaded = "lfs", True
            operations.append(operation)
        for name, content in {**self.inline, **files}.items():
            data = content.read_bytes() if isinstance(content, Path) else content
            operations.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=data))
        names = {operation.path_in_repo for operation in operations}
        stale = [
            name
            for name in self.repo_files
            if replace_weights
            and "/" not in name
            and name not in names
            and any(fnmatchcase(name, pattern) for pattern in REPLACED_FILES)
        ]
        operations += [CommitOperationDelete(path_in_repo=name) for name in stale]
        with self._failing("commit failed"), self._session():
            self._retried(
                lambda: self.api.create_commit(
                    self.repo_id,
                    operations=operations,
                    commit_message=DEFAULT_COMMIT_MESSAGE,
                    revision=self.branch,
                )
            )
        self.record.remove()
        self.pushed.committed = len(names)
        url = f"{self.api.endpoint}/{self.repo_id}"
        self.pushed.url = url if self.branch is None else f"{url}/tree/{quote(self.branch, safe='')}"
        return self.pushed

    def status(self) -> str:
        """What the progress bar says of the push."""
        found = sum(size for _, size in self.pushed.found)
        return f"{self.sent / 1e9:.2f} GB uploaded" + (f", {found / 1e9:.2f} GB on the Hub already" if found else "")

    # -- within ----------------------------------------------------------------------------------------------------
    def _retried(self, call):
        """``call()``, tried ``ATTEMPTS`` times with a doubling wait while it fails for a cause that may pass (the
        network, a 5xx or 429 answer)."""
        for attempt in range(ATTEMPTS):
            try:
                return call()
            except Exception as error:  # noqa: BLE001
                if attempt == ATTEMPTS - 1 or not _passing(error):
                    raise
                time.sleep(FIRST_WAIT * 2**attempt)
        raise AssertionError("unreachable")

    @contextlib.contextmanager
    def _failing(self, what: str):
        """Whatever the Hub, the network or hf_xet raise, as one UploadError line: what failed, why, what is kept, and
        the command that finishes the job."""
        try:
            yield
        except (UploadError, Interrupted, Terminated, KeyboardInterrupt):
            raise
        except Exception as error:  # noqa: BLE001
            raise UploadError(f"{self.repo_id}: {what}: {hub_error_line(error)}; {self.kept()}") from error

    def kept(self) -> str:
        """What an interrupted push leaves, and how to finish it."""
        recorded = len(self.record.files) if self.record is not None else 0
        where = f" (recorded in {self.record.path})" if recorded else ""
        again = f": {self.again}" if self.again else ""
        files = f"{recorded} file{'s' if recorded != 1 else ''}"
        return (
            f"nothing was committed; {files} uploaded and kept on the Hub{where}; run the same command again to "
            f"finish{again}"
        )


def _info(entry: dict, UploadInfo):
    return UploadInfo(
        size=entry["size"], sample=base64.b64decode(entry["sample"]), sha256=bytes.fromhex(entry["sha256"])
    )


def _passing(error: BaseException) -> bool:
    """Whether a failure may pass on its own: the network, or the Hub's 5xx and 429 answers."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    if status is not None:
        return status >= 500 or status == 429
    return isinstance(error, (OSError, TimeoutError)) or type(error).__name__ in (
        "ConnectError",
        "ReadError",
        "WriteError",
        "RemoteProtocolError",
        "ReadTimeout",
        "WriteTimeout",
        "ConnectTimeout",
        "ConnectionError",
    )


class _Both(contextlib.ExitStack):
    def __init__(self, *managers):
        super().__init__()
        self._managers = managers

    def __enter__(self):
        super().__enter__()
        for manager in self._managers:
            self.enter_context(manager)
        return self
