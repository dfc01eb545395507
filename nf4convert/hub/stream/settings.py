"""How a repo's files are streamed (the settings and the page a digest covers) and what a run read (the counts)."""

from __future__ import annotations

from dataclasses import dataclass

PAGE_BYTES = 1 << 16  # the unit whose digest two reads of the same bytes are compared by
DIGEST_BYTES = 16  # of a page's sha256: a page fetched again must match this much of the first copy's


@dataclass(frozen=True)
class StreamSettings:
    """How a repo's files are streamed; the defaults suit the Hub from a data-centre link."""

    block_bytes: int = 1 << 23  # one request: large enough that per-request latency is amortized
    memory_bytes: int = 1 << 28  # blocks held at once, all files together
    requests_at_once: int = 8  # fetch threads (reads that must wait for a block fetch it themselves, beside them)
    ahead_blocks: int = 8  # how far a stream prefetches, at most
    streams_per_file: int = 8  # read positions followed in one file (output shards written at once, each its own)
    tries: int = 6  # of one range without a byte received, before the run fails
    # answers in a row that each brought bytes but ended before their length: a server or proxy that cuts every
    # answer short makes progress forever, one slow step at a time, unless this ends it
    short_answers_most: int = 12
    range_seconds_most: float = 600.0  # retrying one range for longer than this fails the run
    wait_first: float = 1.0  # seconds before the second try; doubled for each next one
    wait_most: float = 16.0
    retry_after_most: float = 300.0  # a longer Retry-After fails the run rather than waiting
    timeout: float | None = None  # seconds without a byte before a read is tried again; None: HF_HUB_DOWNLOAD_TIMEOUT
    # "auto": hf_xet for a Xet file where it is installed, else HTTP; "http": HTTP only; "httpx": HTTP through
    # huggingface_hub's client only (as through a proxy); "xet": hf_xet for Xet files
    transport: str = "auto"


@dataclass
class StreamStats:
    """What a run read: bytes fetched from the Hub (all of them, and those fetched a second time), read from the Hub
    cache, and the retries it took."""

    fetched: int = 0
    fetched_again: int = 0
    cached: int = 0
    retries: int = 0
