"""huggingface_hub's HTTP session as nf4convert talks to the Hub through it: every request bounded in time, and
huggingface_hub's own log lines kept off a quiet run's terminal.

huggingface_hub sends its API calls (a repo's info, its file listing, a commit) without a timeout, and retries a file's
metadata with a longer one than HF_HUB_ETAG_TIMEOUT: an endpoint that accepts the connection and never answers held
a run for as long as it liked. While ``hub_session`` is entered, each request of its shared session gets the Hub's
own bounds where it has none, as huggingface_hub reads them from the environment: HF_HUB_ETAG_TIMEOUT for connecting
and for the answer to an API call or a file's metadata, HF_HUB_DOWNLOAD_TIMEOUT where huggingface_hub sets it (a
download's reads), and ``ANSWER_SECONDS`` for the answer to a request that hands the Hub data (a commit, an upload),
which the Hub may take a while to store. Each bound is per network operation (connecting, waiting for the
next bytes), as the HTTP clients count it, not for a whole transfer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

ANSWER_SECONDS = 300  # for a commit's or an upload's answer: the Hub hashes and stores what it got first


def bounds(method: str, path: str, given: dict | None, etag: float, download: float) -> dict:
    """The timeouts (httpx's ``connect``, ``read``, ``write``, ``pool``) of a ``method`` request to ``path`` sent with
    ``given`` (None where unset): those it has, each bounded, and the Hub's where it has none."""
    given = given or {}
    method = method.upper()
    answer = ANSWER_SECONDS if method == "PUT" or "/commit/" in path else etag
    read = given.get("read")
    if read is None:
        read = answer
    elif method == "HEAD":  # huggingface_hub's retry of a file's metadata waits longer than HF_HUB_ETAG_TIMEOUT says
        read = min(read, etag)
    connect = given.get("connect")
    return {
        "connect": etag if connect is None else min(connect, etag),
        "read": read,
        "write": given.get("write") if given.get("write") is not None else max(answer, download),
        "pool": given.get("pool") if given.get("pool") is not None else max(answer, download),
    }


def _bounded(request) -> None:
    """httpx's request hook: the request's timeouts bounded (``bounds``) before it is sent."""
    from huggingface_hub import constants

    request.extensions["timeout"] = bounds(
        request.method,
        request.url.path,
        request.extensions.get("timeout"),
        constants.HF_HUB_ETAG_TIMEOUT,
        constants.HF_HUB_DOWNLOAD_TIMEOUT,
    )


class _BoundedSend:
    """requests' adapter ``send`` (huggingface_hub 0.x) with a timeout where the caller gave none."""

    def __init__(self, send):
        self.send = send

    def __call__(self, request, timeout=None, **kwargs):
        from huggingface_hub import constants

        if timeout is None:
            carries = request.method == "PUT" or "/commit/" in (request.path_url or "")
            timeout = (constants.HF_HUB_ETAG_TIMEOUT, ANSWER_SECONDS if carries else constants.HF_HUB_ETAG_TIMEOUT)
        return self.send(request, timeout=timeout, **kwargs)


def bound_requests() -> None:
    """Bound every request of huggingface_hub's shared session from now on (``bounds``). Idempotent; done again at
    each entry, since huggingface_hub makes a new session after a fork or a connection error."""
    from huggingface_hub.utils import get_session

    session = get_session()
    hooks = getattr(session, "event_hooks", None)
    if isinstance(hooks, dict):  # httpx (huggingface_hub 1.x) or httpx2 (2.x)
        if _bounded not in hooks.get("request", []):
            hooks = {**hooks, "request": [*hooks.get("request", []), _bounded]}
            session.event_hooks = hooks
        return
    for adapter in getattr(session, "adapters", {}).values():  # requests (huggingface_hub 0.x)
        if not isinstance(adapter.send, _BoundedSend):
            adapter.send = _BoundedSend(adapter.send)


@contextlib.contextmanager
def hub_session(*, quiet: bool) -> Iterator[None]:
    """Requests to the Hub bounded in time for the block (``bound_requests``); with ``quiet``, huggingface_hub's log
    lines (its retries: "Retrying in 1s", a request's error before it is retried) kept off standard error, where the
    run's own one line says what failed."""
    bound_requests()
    if not quiet:
        yield
        return
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
