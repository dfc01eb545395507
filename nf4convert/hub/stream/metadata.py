"""What the Hub says of a file at one commit: its size, the hash its bytes must have and where they are."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ...errors import SourceNotFoundError
from ..errors import hub_error_line


@dataclass(frozen=True)
class Expected:
    """The hash a file's bytes must have: an LFS file's sha256 (``X-Linked-Etag``; the Hub cache names its blob by it),
    or for a file kept in git its blob id (the sha1 of ``blob <size>\\0`` and the bytes)."""

    kind: str  # "sha256" or "git-sha1"
    hexdigest: str

    @classmethod
    def of_etag(cls, etag: str | None) -> Expected | None:
        """What an ETag (or a cache blob's name) says the bytes hash to; None for anything else."""
        etag = (etag or "").strip().strip('"').lower()
        if etag.startswith("w/"):  # a weak ETag names no exact bytes
            return None
        if re.fullmatch(r"[0-9a-f]{64}", etag):
            return cls("sha256", etag)
        if re.fullmatch(r"[0-9a-f]{40}", etag):
            return cls("git-sha1", etag)
        return None

    def hasher(self, size: int):
        if self.kind == "sha256":
            return hashlib.sha256()
        hasher = hashlib.sha1()
        hasher.update(b"blob %d\0" % size)
        return hasher

    @property
    def shown(self) -> str:
        return f"{'sha256' if self.kind == 'sha256' else 'git blob id'} {self.hexdigest[:16]}…"


@dataclass(frozen=True)
class RemoteFileInfo:
    """A file of a repo at one commit, as the Hub describes it."""

    name: str
    size: int
    expected: Expected
    url: str  # the file's resolve URL at the commit: where a new storage link is asked for
    location: str  # where its bytes are read: the storage's signed link (a redirect's target), or the URL itself
    xet_hash: str | None = None  # a Xet file's hash, and the route that gives a Xet read token
    xet_refresh: str | None = None


def expected_of_cached(path: Path) -> Expected | None:
    """The hash a file of a Hub cache snapshot must have, by the blob it links to (named by its sha256 or its git blob
    id); None for a file that is no cache blob."""
    return Expected.of_etag(Path(os.path.realpath(path)).name)


def describe(
    repo_id: str, commit: str, name: str, *, token: str | bool | None = None, endpoint: str | None = None
) -> RemoteFileInfo:
    """What the Hub says of file ``name`` at ``commit``: its size, the hash of its bytes, where they are (a HEAD at the
    commit, as huggingface_hub's downloads ask)."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url

    where = f"{repo_id}@{commit[:12]}: {name}"
    url = hf_hub_url(repo_id, name, revision=commit, endpoint=endpoint)
    try:
        try:
            metadata = get_hf_file_metadata(
                url, token=token, timeout=constants.HF_HUB_ETAG_TIMEOUT, endpoint=endpoint, retry_on_errors=True
            )
        except TypeError:  # huggingface_hub before retry_on_errors
            metadata = get_hf_file_metadata(url, token=token, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as error:  # noqa: BLE001  (HTTP, network, offline: one line that keeps the cause)
        raise SourceNotFoundError(f"{where}: cannot be read from the Hub: {hub_error_line(error)}") from None
    if metadata.commit_hash is not None and re.fullmatch(r"[0-9a-f]{40}", commit) and metadata.commit_hash != commit:
        raise SourceNotFoundError(f"{where}: the Hub answered for commit {metadata.commit_hash[:12]}, not this one")
    expected = Expected.of_etag(metadata.etag)
    if expected is None:
        raise SourceNotFoundError(
            f"{where}: the Hub gives no hash of it to check its bytes against (ETag {metadata.etag!r}); "
            "download it instead"
        )
    if metadata.size is None:
        raise SourceNotFoundError(f"{where}: the Hub does not say its size; download it instead")
    xet = metadata.xet_file_data
    return RemoteFileInfo(
        name=name,
        size=int(metadata.size),
        expected=expected,
        url=url,
        location=metadata.location or url,
        xet_hash=None if xet is None else xet.file_hash,
        xet_refresh=None if xet is None else xet.refresh_route,
    )
