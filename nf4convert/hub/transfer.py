"""One range of a Hub file, fetched once: over HTTP (http.client straight into the caller's buffer for the storage's
signed links, huggingface_hub's client through a proxy and for the Hub's own files) or through hf_xet's ranged
streams for a Xet file; each answer checked before its body is taken (a status worth asking again for, an expired
link renewed, a range not the one asked). ``stream/`` owns the tries, the blocks and the hashes; a transfer reports
what it received in ``Part.received`` whatever happens, so that the next try starts from there.

A transfer is made for an owner (``stream.RemoteFiles``: ``settings``, ``token``, ``repo_id``, ``where(name)``,
``closing``, ``note_received(size)``, ``renew_link(file)``) and fetches for a file
(``stream.RemoteFile``: ``name``, ``size``, ``info``, ``location``), both read by their attributes: this module
imports nothing of stream/, which imports it.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections.abc import Iterator
from email.utils import parsedate_to_datetime
from urllib.parse import urlsplit

from ..errors import FetchError, IntegrityError

RETRY_STATUSES = (408, 429, 500, 502, 503, 504)
LINK_STATUSES = (401, 403, 404, 410)  # from the storage a link points to: the link expired; ask the Hub for a new one
CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")
BAR_STEP = 1 << 20  # bytes received between two calls of ``on_bytes``


class Part:
    """A range being fetched: its first byte, where its bytes go, how many arrived."""

    __slots__ = ("first", "into", "received")

    def __init__(self, first: int, into: memoryview):
        self.first, self.into, self.received = first, into, 0


class Retry(Exception):
    """An answer worth asking again for (a 5xx, a 429, an expired link), and how long the Hub asks to wait."""

    def __init__(self, reason: str, after: float | None = None):
        super().__init__(reason)
        self.reason, self.after = reason, after


class Closed(Exception):
    """The files were closed while a range was being fetched."""


class Http:
    """Ranges over HTTP with huggingface_hub's client (its proxies, certificates and user agent): a GET with a Range
    at the file's storage link, the token sent to the Hub's own host only."""

    def __init__(self, owner):
        from huggingface_hub import constants
        from huggingface_hub.utils import build_hf_headers, get_session

        self.owner = owner
        self.headers = {**build_hf_headers(token=owner.token), "Accept-Encoding": "identity"}
        self.session = get_session()
        self.timeout = owner.settings.timeout or constants.HF_HUB_DOWNLOAD_TIMEOUT
        self.hub = origin(constants.ENDPOINT)

    def attempt(self, file, part: Part) -> None:
        owner = self.owner
        first, last = part.first + part.received, part.first + len(part.into) - 1
        location = file.location
        headers = dict(self.headers)
        if origin(location) not in (self.hub, origin(file.info.url)):  # a signed storage link: no token
            headers = {key: value for key, value in headers.items() if key.lower() != "authorization"}
        headers["Range"] = f"bytes={first}-{last}"
        with get(self.session, location, headers, self.timeout) as (status, answer, body):
            answered(owner, file, location, status, answer, first, last)
            take(owner, part, body, part.first + len(part.into) - first)

    def close(self) -> None:
        pass  # the client is huggingface_hub's, shared: it stays open


def answered(owner, file, location: str, status: int, answer, first: int, last: int) -> None:
    """Check an answer's status and Content-Range before its body is read: a range to ask again for (Retry, the
    storage link renewed when it expired), a failure no try mends (FetchError), or the bytes asked for."""
    if status in LINK_STATUSES and location != file.info.url:
        owner.renew_link(file)
        raise Retry(f"HTTP {status} from the Hub's storage (its link expired?)")
    if status in RETRY_STATUSES:
        raise Retry(f"HTTP {status} from {urlsplit(location).netloc}", retry_after(answer))
    where = f"{owner.where(file.name)}: bytes {first}-{last}"
    if status == 200 and first == 0 and last == file.size - 1:
        return  # the whole file, as asked
    if status == 200:
        raise FetchError(f"{where}: the Hub's storage answered with the whole file, not the range asked")
    if status != 206:
        raise FetchError(f"{where}: HTTP {status} from {urlsplit(location).netloc}")
    found = CONTENT_RANGE.fullmatch((answer.get("Content-Range") or "").strip())
    if found is None or int(found[1]) != first or int(found[2]) > last:
        raise FetchError(f"{where}: answered with Content-Range {answer.get('Content-Range')!r}")
    if int(found[3]) != file.size:
        raise IntegrityError(
            f"{owner.where(file.name)}: the Hub's storage holds {found[3]} bytes, its metadata says "
            f"{file.size}: not the commit's file"
        )


class Direct:
    """Ranges of the Hub's storage links (signed, no token) over http.client: a kept-alive connection per thread and
    host, each body read straight into its block (``readinto``: no copy, the GIL let go while the socket fills),
    several times faster than a Python HTTP client's loop over small chunks. Taken where no proxy applies (else
    huggingface_hub's client, which follows the proxy settings); the same checks of every answer."""

    def __init__(self, owner):
        from huggingface_hub import constants
        from huggingface_hub.utils import build_hf_headers

        self.owner = owner
        agent = {key: value for key, value in build_hf_headers(token=False).items() if key.lower() == "user-agent"}
        self.headers = {**agent, "Accept-Encoding": "identity"}
        self.timeout = owner.settings.timeout or constants.HF_HUB_DOWNLOAD_TIMEOUT
        self.local = threading.local()
        self.opened: list = []
        self.lock = threading.Lock()
        self.context = None

    def attempt(self, file, part: Part) -> None:
        owner = self.owner
        first, last = part.first + part.received, part.first + len(part.into) - 1
        location = file.location
        url = urlsplit(location)
        connection = self._connection(url.scheme, url.hostname, url.port)
        try:
            target = url.path + (f"?{url.query}" if url.query else "")
            connection.request("GET", target, headers={**self.headers, "Range": f"bytes={first}-{last}"})
            response = connection.getresponse()
            try:
                answered(owner, file, location, response.status, response.headers, first, last)
            except BaseException:
                response.read(1 << 16)  # a short error body: the connection stays usable, else it is closed
                raise
            unreported = 0
            while part.received < len(part.into):
                if owner.closing.is_set():
                    raise Closed
                got = response.readinto(part.into[part.received : part.received + (1 << 22)])
                if not got:
                    break
                part.received += got
                unreported += got
                if unreported >= BAR_STEP:
                    owner.note_received(unreported)
                    unreported = 0
            if unreported:
                owner.note_received(unreported)
            if response.length and part.received == len(part.into):
                raise FetchError(f"{owner.where(file.name)}: an answer held more bytes than the range asked")
            if response.length:  # the connection closed before the body's end: asked again from there
                got = part.received - (first - part.first)
                raise Retry(f"the connection closed after {got} of {got + response.length} bytes of the answer")
        except BaseException:
            self._drop(url.scheme, url.hostname, url.port)
            raise

    def _connection(self, scheme: str, host: str, port: int | None):
        import http.client

        connections = getattr(self.local, "connections", None)
        if connections is None:
            connections = self.local.connections = {}
        key = (scheme, host, port)
        connection = connections.get(key)
        if connection is None:
            if scheme == "https":
                connection = http.client.HTTPSConnection(host, port, timeout=self.timeout, context=self._context())
            else:
                connection = http.client.HTTPConnection(host, port, timeout=self.timeout)
            connections[key] = connection
            with self.lock:
                self.opened.append(connection)
        return connection

    def _drop(self, scheme: str, host: str, port: int | None) -> None:
        connection = getattr(self.local, "connections", {}).pop((scheme, host, port), None)
        if connection is not None:
            connection.close()

    def _context(self):
        """TLS as huggingface_hub's client verifies it: certifi's authorities, or the bundle the environment names."""
        import ssl

        if self.context is None:
            bundle = os.environ.get("SSL_CERT_FILE") or os.environ.get("REQUESTS_CA_BUNDLE")
            if bundle is None:
                with contextlib.suppress(ImportError):
                    import certifi

                    bundle = certifi.where()
            self.context = ssl.create_default_context(cafile=bundle)
        return self.context

    def close(self) -> None:
        with self.lock:
            for connection in self.opened:
                with contextlib.suppress(Exception):
                    connection.close()
            self.opened.clear()


def direct_reaches(location: str, resolve: str, endpoint: str) -> bool:
    """Whether a link is read with http.client: a storage link off the Hub's hosts (no token to send), reached
    without a proxy."""
    import urllib.request

    url = urlsplit(location)
    if url.scheme not in ("http", "https") or origin(location) in (origin(resolve), origin(endpoint)):
        return False
    proxies = urllib.request.getproxies()
    return url.scheme not in proxies or bool(urllib.request.proxy_bypass(url.hostname or ""))


def take(owner, part: Part, chunks: Iterator[bytes], most: int) -> None:
    """Copy the chunks of a body into the part (at most ``most`` bytes), counting them as they come."""
    unreported = 0
    try:
        for chunk in chunks:
            if owner.closing.is_set():
                raise Closed
            size = len(chunk)
            if size > most:
                raise FetchError(f"{owner.repo_id}: an answer held more bytes than the range asked")
            part.into[part.received : part.received + size] = chunk
            part.received += size
            most -= size
            unreported += size
            if unreported >= BAR_STEP:
                owner.note_received(unreported)
                unreported = 0
    finally:
        if unreported:
            owner.note_received(unreported)


class Xet:
    """Ranges of Xet files through hf_xet's ordered streams (one group for the repo, its read token refreshed by
    hf_xet at the Hub's route), with hf_xet's own retries off so that every range is tried as an HTTP one is."""

    def __init__(self, owner):
        import hf_xet
        from huggingface_hub.utils import build_hf_headers, get_session

        self.owner = owner
        self.headers = build_hf_headers(token=owner.token)
        self.session = get_session()
        budget = owner.settings.memory_bytes
        config = hf_xet.XetConfig().with_config(
            {
                "client.retry_max_attempts": 1,
                "reconstruction.download_buffer_size": budget,
                "reconstruction.download_buffer_perfile_size": budget // 4,
                "reconstruction.download_buffer_limit": budget,
                "reconstruction.min_prefetch_buffer": owner.settings.block_bytes,
                "reconstruction.min_reconstruction_fetch_size": owner.settings.block_bytes,
            }
        )
        self.session_xet = hf_xet.XetSession(config)
        self.group = None
        self.lock = threading.Lock()
        self.file_info = hf_xet.XetFileInfo

    def _group(self, file):
        with self.lock:
            if self.group is None:
                with get(self.session, file.info.xet_refresh, self.headers, 30) as (status, answer, body):
                    for _ in body:
                        pass
                    if status >= 400:
                        raise Retry(f"HTTP {status} asking for a Xet read token")
                    endpoint = answer.get("X-Xet-Cas-Url")
                    token = answer.get("X-Xet-Access-Token")
                    expiry = answer.get("X-Xet-Token-Expiration")
                if not (endpoint and token and expiry and expiry.isdigit()):
                    raise FetchError(f"{self.owner.where(file.name)}: the Hub gave no Xet read token")
                self.group = self.session_xet.new_download_stream_group(
                    endpoint=endpoint,
                    token=token,
                    token_expiry_unix_secs=int(expiry),
                    token_refresh_url=file.info.xet_refresh,
                    token_refresh_headers=self.headers,
                )
            return self.group

    def attempt(self, file, part: Part) -> None:
        owner = self.owner
        first, end = part.first + part.received, part.first + len(part.into)
        stream = self._group(file).download_stream(self.file_info(file.info.xet_hash, file.size), start=first, end=end)
        try:
            take(owner, part, stream, end - first)
        finally:
            stream.cancel()

    def close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(Exception):
                self.group.abort()


@contextlib.contextmanager
def get(session, url: str, headers: dict, timeout: float) -> Iterator[tuple[int, dict, Iterator[bytes]]]:
    """(status, headers, the body's chunks as they arrive) of a GET with huggingface_hub's client: httpx's (1.x,
    2.x) or requests' (0.x)."""
    if hasattr(session, "stream"):
        with session.stream("GET", url, headers=headers, timeout=timeout, follow_redirects=True) as response:
            yield response.status_code, response.headers, response.iter_raw()
    else:
        response = session.get(url, headers=headers, timeout=timeout, stream=True, allow_redirects=True)
        try:
            yield response.status_code, response.headers, response.raw.stream(1 << 16, decode_content=False)
        finally:
            response.close()


def retry_after(headers) -> float | None:
    """Seconds a Retry-After asks to wait (a number of seconds or an HTTP date), or None."""
    value = (headers.get("Retry-After") or "").strip()
    if not value:
        return None
    if re.fullmatch(r"\d+(?:\.\d+)?", value):
        return float(value)
    with contextlib.suppress(TypeError, ValueError, IndexError, OverflowError):
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    return None


def origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(parts.scheme)
