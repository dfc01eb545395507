"""One range of a file fetched, tried again until it is whole, through the transport that reaches it."""

from __future__ import annotations

import time

from ...errors import FetchError, IntegrityError, Nf4ConvertError
from ..errors import hub_error_line
from ..transfer import Closed, Direct, Http, Part, Retry, Xet, direct_reaches
from .metadata import describe
from .remote import RemoteFile


class Fetching:
    """How :class:`~.files.RemoteFiles` fetches a range and counts what came (a part of it, on its state)."""

    def _fetch(self, file: RemoteFile, first: int, into: memoryview) -> None:
        """``len(into)`` bytes of ``file`` from byte ``first``, retried from the first byte not received yet."""
        part = Part(first, into)
        settings = self.settings
        tries = short = 0
        started = time.monotonic()
        while part.received < len(into):
            before = part.received
            wait = None
            try:
                self._transport(file).attempt(file, part)
                if part.received == len(into):
                    break
                reason = f"the answer ended after {part.received - before} of {len(into) - before} bytes"
            except Retry as retry:
                reason, wait = retry.reason, retry.after
            except Nf4ConvertError:
                raise
            except Closed:
                raise FetchError(f"{self.where(file.name)}: stopped") from None
            except Exception as error:  # noqa: BLE001  (the HTTP client's or hf_xet's: a connection, a timeout)
                reason = hub_error_line(error)
            tries = 1 if part.received > before else tries + 1  # bytes received: the range is making progress
            short = short + 1 if part.received > before else 0
            with self._lock:
                self.stats.retries += 1
            last = part.first + len(into) - 1
            where = f"{self.where(file.name)}: bytes {part.first + part.received}-{last}"
            if tries >= settings.tries:
                raise FetchError(f"{where}: {reason}, after {tries} tries", tries=tries)
            if short >= settings.short_answers_most:
                raise FetchError(
                    f"{where}: the server ends its answers early ({short} answers in a row stopped before the length "
                    "they announced): a proxy or the storage cuts them short",
                    tries=short,
                )
            if time.monotonic() - started > settings.range_seconds_most:
                raise FetchError(
                    f"{where}: {reason}, still not whole after {settings.range_seconds_most:.0f} s of tries",
                    tries=tries,
                )
            if wait is not None and wait > settings.retry_after_most:
                raise FetchError(f"{where}: {reason}, and the Hub asks to wait {wait:.0f} s", tries=tries)
            pause = wait if wait is not None else min(settings.wait_most, settings.wait_first * 2 ** (tries - 1))
            if self.closing.wait(pause):
                raise FetchError(f"{self.where(file.name)}: stopped")

    def _transport(self, file: RemoteFile):
        """hf_xet for a Xet file where it is installed (or asked for); else http.client for a storage link reached
        without a proxy; else huggingface_hub's client."""
        from huggingface_hub import constants

        if file.info.xet_hash and self._use_xet():
            kind = "xet"
        elif self.settings.transport != "httpx" and direct_reaches(file.location, file.info.url, constants.ENDPOINT):
            kind = "direct"
        else:
            kind = "httpx"
        transport = self._transports.get(kind)
        if transport is None:
            with self._making:  # not the main lock: making hf_xet's session takes a while
                transport = self._transports.get(kind)
                if transport is None:
                    transport = self._transports[kind] = {"xet": Xet, "direct": Direct, "httpx": Http}[kind](self)
        return transport

    def _use_xet(self) -> bool:
        if self.settings.transport != "auto":
            return self.settings.transport == "xet"
        from huggingface_hub import constants

        if constants.HF_HUB_DISABLE_XET:
            return False
        try:
            import hf_xet  # noqa: F401
        except ImportError:
            return False
        return True

    def note_received(self, size: int) -> None:
        with self._lock:
            self.stats.fetched += size
        if self.on_bytes is not None:
            self.on_bytes(size)

    def renew_link(self, file: RemoteFile) -> None:
        """Ask the Hub again (at the commit) where the file's bytes are: its storage link expired."""
        info = describe(self.repo_id, self.commit, file.name, token=self.token, endpoint=self.endpoint)
        if info.expected != file.info.expected or info.size != file.size:
            raise IntegrityError(
                f"{self.where(file.name)}: the Hub now describes it as {info.size} bytes of {info.expected.shown}, "
                f"not {file.size} bytes of {file.info.expected.shown}"
            )
        file.location = info.location
