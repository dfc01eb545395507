"""One line for any error met talking to the Hub, keeping its cause.

huggingface_hub raises its own HTTP errors (``HfHubHTTPError`` and subclasses, whose text spans several lines),
and lets the HTTP client's errors through: httpx (huggingface_hub 1.x), httpx2 (2.x) or requests (0.x), whose
text is a chain like "HTTPSConnectionPool(...): Max retries exceeded ... (Caused by NameResolutionError(...))".
hf_xet, which moves the bytes of large files, raises RuntimeError or its own errors. ``hub_error_line`` reads
them all by their attributes, not their types, so it imports none of those libraries and works with any version.

Example:
    >>> try:
    ...     snapshot_download("org/name")
    ... except Exception as error:
    ...     raise SourceNotFoundError(f"org/name: {hub_error_line(error)}") from error
    "HTTP 401 Unauthorized from GET https://huggingface.co/api/models/org/name/revision/main: the token was
     rejected or is missing (give a token, or set HF_TOKEN) [server: Invalid credentials in Authorization header]"
"""

from __future__ import annotations

import errno
import re
from urllib.parse import urlsplit

MAX_MESSAGE = 300  # characters of a server's or a library's message kept in the line

# What to do next, by HTTP status, for statuses whose error type says no more.
STATUS_HINTS = {
    401: "the token was rejected or is missing (give a token, or set HF_TOKEN)",
    402: "the Hub asks for payment for this operation",
    403: "the token lacks the permission (an upload needs write access to the namespace; a gated repo, its terms)",
    404: "not found (check the repo id and revision; a private repo needs a token)",
    409: "conflict with the repo's current state",
    413: "the request is too large for the Hub",
    429: "rate limited by the Hub; wait and try again",
}
# huggingface_hub's error types that say more than the status (checked by class name, through the MRO, so
# that no version of huggingface_hub has to be imported).
TYPE_HINTS = {
    "GatedRepoError": "gated repository: accept its terms on the Hub, then give a token (or set HF_TOKEN)",
    "DisabledRepoError": "the repository is disabled on the Hub",
    "RepositoryNotFoundError": "repository not found (or private, and the token cannot see it)",
    "RevisionNotFoundError": "revision not found in the repository",
    "RemoteEntryNotFoundError": "file not found in the repository",
    "EntryNotFoundError": "file not found in the repository",
    "BadRequestError": "the Hub refused the request as invalid",
}
# The Hub's X-Error-Code header, for clients that do not turn it into a type (requests under huggingface_hub 0.x).
CODE_HINTS = {
    "GatedRepo": TYPE_HINTS["GatedRepoError"],
    "RepoNotFound": TYPE_HINTS["RepositoryNotFoundError"],
    "RevisionNotFound": TYPE_HINTS["RevisionNotFoundError"],
    "EntryNotFound": TYPE_HINTS["EntryNotFoundError"],
}
NAME_RESOLUTION = re.compile(
    r"name or service not known|nodename nor servname|temporary failure in name resolution|getaddrinfo failed"
    r"|no address associated|failed to resolve|nameresolutionerror|dns error|could not resolve",
    re.IGNORECASE,
)
REFUSED = re.compile(r"connection refused|errno 111\b|errno 61\b|10061", re.IGNORECASE)
TIMEOUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)
TLS = re.compile(r"certificate|ssl|tls", re.IGNORECASE)
URL = re.compile(r"https?://[^\s/'\")]+")


def hub_error_line(error: BaseException) -> str:
    """One line saying what went wrong talking to the Hub and why: the HTTP status with the server's message
    and the request, or the network failure (name resolution, refused connection, timeout, TLS) and its host.
    Never raises; an error it does not know gives its type and its message, on one line."""
    try:
        return _line(error)
    except Exception:  # noqa: BLE001  (a message must come out whatever the error looks like)
        return f"{type(error).__name__}: {_one_line(error)}"


def cause_line(error: BaseException) -> str | None:
    """The HTTP answer or the network failure behind ``error`` (a LocalEntryNotFoundError that huggingface_hub raised
    for it, say), in one line as ``hub_error_line`` says it; None where the error holds neither. Never raises."""
    try:
        chain = _chain(error)
        return _http_cause(chain) or _network_line(chain)
    except Exception:  # noqa: BLE001  (as hub_error_line: whatever the error looks like)
        return None


def _http_cause(chain: list[BaseException]) -> str | None:
    for link in chain:  # an HTTP answer, even when wrapped (LocalEntryNotFoundError from a 5xx...)
        response = getattr(link, "response", None)
        if response is not None and isinstance(getattr(response, "status_code", None), int):
            return _http_line(link, response)
    return None


def _line(error: BaseException) -> str:
    chain = _chain(error)
    answered = _http_cause(chain)
    if answered is not None:
        return answered
    names = {cls.__name__ for link in chain for cls in type(link).__mro__}
    if "OfflineModeIsEnabled" in names:
        offline = "offline mode (HF_HUB_OFFLINE=1) forbids reaching the Hub"
        return f"not in the local cache, and {offline}" if "LocalEntryNotFoundError" in names else offline
    network = _network_line(chain)
    if network is not None:
        if "LocalEntryNotFoundError" in names:
            return f"not in the local cache, and the Hub cannot be reached: {network}"
        return network
    if "LocalEntryNotFoundError" in names:
        return "not in the local cache, and the Hub was not asked (offline, or no network)"
    if "XetAuthenticationError" in names:
        return f"the Xet storage refused the token: {_one_line(error)}"
    if "HFValidationError" in names:
        return f"invalid repo id or revision: {_one_line(error)}"
    malformed = _malformed_answer(chain)
    if malformed is not None:
        return malformed
    return f"{type(error).__name__}: {_one_line(error)}"


# What huggingface_hub raises reading an answer that is not the Hub API's (not JSON; JSON of another shape)
_READING_ERRORS = ("JSONDecodeError", "KeyError", "TypeError", "AttributeError", "IndexError", "AssertionError")


def _malformed_answer(chain: list[BaseException]) -> str | None:
    """An answer huggingface_hub could not read as the Hub API's, said as such, with the endpoint that gave it: what
    the library's own error (a KeyError for a missing field) leaves to be guessed."""
    for link in chain:
        names = {cls.__name__ for cls in type(link).__mro__}
        if not names & set(_READING_ERRORS):
            continue
        frames, traceback = [], link.__traceback__
        while traceback is not None:
            frames.append(traceback.tb_frame.f_code.co_filename)
            traceback = traceback.tb_next
        if "JSONDecodeError" in names or any("huggingface_hub" in frame for frame in frames[-3:]):
            from huggingface_hub import constants

            what = "not JSON" if "JSONDecodeError" in names else "JSON of another shape"
            return (
                f"the answer from {constants.ENDPOINT} is not the Hub API's ({what}: {type(link).__name__}: "
                f"{_one_line(link)}); is HF_ENDPOINT a Hub?"
            )
    return None


def _http_line(error: BaseException, response) -> str:
    status = response.status_code
    reason = getattr(response, "reason_phrase", None) or getattr(response, "reason", None) or ""
    where = _request_text(getattr(response, "request", None))
    hint = next((TYPE_HINTS[cls.__name__] for cls in type(error).__mro__ if cls.__name__ in TYPE_HINTS), None)
    if hint is None:
        headers = getattr(response, "headers", None)
        hint = CODE_HINTS.get(headers.get("X-Error-Code")) if hasattr(headers, "get") else None
    if hint is None:
        hint = STATUS_HINTS.get(status) or ("the Hub had a server error; try again later" if status >= 500 else "")
    line = " ".join(filter(None, [f"HTTP {status}", str(reason), f"from {where}" if where else ""]))
    if hint:
        line += f": {hint}"
    server = _server_message(error, response)
    if server:
        line += f" [server: {server}]"
    request_id = getattr(error, "request_id", None)
    if request_id:
        line += f" [request id {request_id}]"
    return line


def _server_message(error: BaseException, response) -> str:
    message = getattr(error, "server_message", None)
    if not message:
        headers = getattr(response, "headers", None) or {}
        message = headers.get("X-Error-Message") if hasattr(headers, "get") else None
    if not message:
        try:
            payload = response.json()
            message = payload.get("error") if isinstance(payload, dict) else None
        except Exception:  # noqa: BLE001  (a body that is not JSON: no server message)
            message = None
    if not isinstance(message, str):
        return ""
    return _shorten(" ".join(message.split()))


def _request_text(request) -> str:
    if request is None:
        return ""
    url = getattr(request, "url", None)
    if url is None:
        return ""
    parts = urlsplit(str(url))
    shown = f"{parts.scheme}://{parts.netloc}{parts.path}" if parts.netloc else str(url)
    method = getattr(request, "method", None)
    return f"{method} {shown}" if method else shown


def _network_line(chain: list[BaseException]) -> str | None:
    """The network failure in an error chain, most specific cause first, with the host it concerns."""
    texts = " | ".join(f"{type(link).__name__}: {_text(link)}" for link in chain)
    host = next(filter(None, (_host(link) for link in chain)), None)
    if host is None and (url := URL.search(texts)):  # hf_xet (Rust) errors name the URL only in their text
        host = urlsplit(url.group(0)).netloc
    at = f" {host}" if host else ""
    names = {cls.__name__ for link in chain for cls in type(link).__mro__}
    codes = {getattr(link, "errno", None) for link in chain}
    if "gaierror" in names or "NameResolutionError" in names or NAME_RESOLUTION.search(texts):
        return f"cannot resolve the host name{at} (no network or DNS; or a wrong HF_ENDPOINT?)"
    if "ConnectionRefusedError" in names or codes & {errno.ECONNREFUSED} or REFUSED.search(texts):
        return f"connection refused by{at or ' the server'} (is the endpoint right, and the server up?)"
    if names & {
        "TimeoutError",
        "timeout",
        "TimeoutException",
        "Timeout",
        "ConnectTimeout",
        "ReadTimeout",
        "WriteTimeout",
        "PoolTimeout",
        "ConnectTimeoutError",
        "ReadTimeoutError",
    } or (names & {"ConnectError", "ConnectionError", "NetworkError", "TransportError"} and TIMEOUT.search(texts)):
        kind = "connecting to" if names & {"ConnectTimeout", "ConnectTimeoutError"} else "waiting for"
        return f"timed out {kind}{at or ' the server'} (slow or no network; try again)"
    connect_failed = bool(names & {"ConnectError", "ConnectionError"})
    if names & {"SSLError", "SSLCertVerificationError"} or (connect_failed and TLS.search(texts)):
        return f"TLS error with{at or ' the server'}: {first_line(chain[-1])}"
    if connect_failed or names & {
        "NetworkError",
        "TransportError",
        "RemoteProtocolError",
        "ProtocolError",
        "ReadError",
        "WriteError",
        "ChunkedEncodingError",
        "ConnectionResetError",
    }:
        return f"network error with{at or ' the server'}: {_cause_text(chain)}"
    return None


# What a client error without a message means, by its type
_DESCRIBED = {
    "RemoteProtocolError": "the server broke off the HTTP exchange",
    "ProtocolError": "the server broke off the HTTP exchange",
    "ReadError": "the connection broke while reading the answer",
    "WriteError": "the connection broke while sending the request",
    "ConnectionResetError": "the server reset the connection",
    "ChunkedEncodingError": "the answer's body was cut off",
}


def _cause_text(chain: list[BaseException]) -> str:
    """The deepest message in an error chain, or what the deepest error's type means where none has a message."""
    for link in reversed(chain):
        lines = [" ".join(line.split()) for line in _text(link).splitlines() if line.strip()]
        if lines:
            return _shorten(lines[0])
    names = [cls.__name__ for link in reversed(chain) for cls in type(link).__mro__]
    return next((_DESCRIBED[name] for name in names if name in _DESCRIBED), f"{names[0]}, without a message")


def _host(error: BaseException) -> str | None:
    """The host:port a client error was about: httpx's request, requests' request, urllib3's pool."""
    try:
        request = error.request  # httpx's RequestError.request raises RuntimeError when it has none
    except Exception:  # noqa: BLE001
        request = None
    url = getattr(request, "url", None)
    if url is not None:
        parts = urlsplit(str(url))
        if parts.netloc:
            return parts.netloc
    pool = getattr(error, "pool", None)  # urllib3's MaxRetryError / NewConnectionError
    if pool is not None and getattr(pool, "host", None):
        return f"{pool.host}:{pool.port}" if getattr(pool, "port", None) else pool.host
    return None


def _chain(error: BaseException) -> list[BaseException]:
    """The error, its causes and contexts, and what requests/urllib3 keep in ``args`` and ``reason``."""
    seen, order, todo = set(), [], [error]
    while todo and len(order) < 32:
        link = todo.pop(0)
        if id(link) in seen:
            continue
        seen.add(id(link))
        order.append(link)
        nested = [link.__cause__, link.__context__, getattr(link, "reason", None)]
        nested += [arg for arg in getattr(link, "args", ()) if isinstance(arg, BaseException)]
        todo += [item for item in nested if isinstance(item, BaseException)]
    return order


def _one_line(error: BaseException) -> str:
    """All of a message on one line (huggingface_hub puts the useful part of a ValueError on its later lines)."""
    return _shorten(" ".join(_text(error).split())) or type(error).__name__


def _text(error: BaseException) -> str:
    try:
        return str(error)
    except Exception:  # noqa: BLE001  (an error whose __str__ fails still gets a line)
        return ""


def _shorten(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def first_line(error: BaseException) -> str:
    lines = [" ".join(line.split()) for line in _text(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
