"""A Hub repo's weight files at one commit, read in place of a local copy: positional reads (``pread``) served from
HTTP range requests (or hf_xet's ranged streams), many in flight, never written to disk, every byte checked against
the Hub's hash of its file.

Design. A file is cut into blocks (``StreamSettings.block_bytes``, one request each). Reads are watched as streams: a
read that continues one (the pipeline reads each file roughly front to back, a few files or output shards at once) makes
that stream prefetch the blocks ahead of it, on a pool of fetch threads, within a memory budget shared by the files; a
read that continues none (a header, a quant state, a scale read out of order) fetches just the pages it covers, in the
reading thread, except in a file of one block, fetched whole at its first read. Each range is fetched with its own
retries: a dropped connection, a 5xx, a 429 (its Retry-After honoured), a stalled read (the download timeout) or a short
body is asked again from the first byte not yet received, with backoff; a range that fails as often as ``tries`` allows
ends the run in one line (:class:`FetchError`) saying what failed, after how many tries. A link of the Hub's storage
that expires is asked for again at the same commit, as is every request: a commit pushed while the run reads cannot mix
versions. How one range is fetched is transfer.py's: the storage's signed links with http.client straight into the
blocks, through a proxy and for files the Hub serves itself with huggingface_hub's client, a Xet file with hf_xet's
ranged streams.

Integrity. The Hub's hash of a file (its LFS sha256, or for a file kept in git its blob id) is a hash of its bytes in
order, while reads come in any order and some bytes are never read (the header region is read apart, a tensor may be
skipped). So each file keeps one hasher fed with its blocks in file order: a block is hashed when every block before
it has been, and held until then within the budget; bytes no read asked for are fetched for the hash alone (behind
the reads while they run, the rest when the caller finishes). A read is served from the copy the hash sees wherever
it can; where the same bytes are fetched twice, the two copies are compared, so the bytes a read was given are the
bytes the file's hash was computed over:

- bytes read apart before the hash reaches them, or read from a block let go before it was hashed: the sha256 of each
  of their pages (``PAGE_BYTES``) is recorded, and the copy the hash sees must match it;
- a block fetched again after the hash has had it: the hash's state is kept at every block's start, and the block
  must carry it from its start state to its end state.

When the hasher reaches a file's end its digest is compared with the Hub's: a mismatch is an :class:`IntegrityError`
naming the file, and it stops every read. A read is served before its file is verified: the caller places nothing
until :meth:`RemoteFiles.finish` has verified every file read. A file already in the Hub cache is read in place
(:class:`CachedFile`) and checked against the hash its blob is named by, by one sequential pass.

Memory: the blocks held (prefetched, not yet read or not yet hashed) stay within ``memory_bytes``; a read that must
wait for a block fetches it even past the budget (those are bounded by the threads reading), and blocks held only for
the hash are let go first when room is needed (fetched again for the hash later). Nothing is written to disk.

Integration: ``RemoteFiles.open(repo, commit, names, token=..., cache=...)`` resolves each file's size, hash and
storage link with a HEAD at the commit (huggingface_hub's ``get_hf_file_metadata``), and ``files[name].pread(offset,
buffer)`` reads; ``stats`` counts what was streamed and what came from the cache, ``on_bytes`` drives a bar.
"""

from .cached import CachedFile
from .files import RemoteFiles
from .metadata import Expected, RemoteFileInfo, describe, expected_of_cached
from .remote import RemoteFile
from .settings import PAGE_BYTES, StreamSettings, StreamStats

__all__ = [
    "PAGE_BYTES",
    "CachedFile",
    "Expected",
    "RemoteFile",
    "RemoteFileInfo",
    "RemoteFiles",
    "StreamSettings",
    "StreamStats",
    "describe",
    "expected_of_cached",
]
