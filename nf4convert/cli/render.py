"""The text the command line prints for each result: a conversion's summary, a dry run's plan, a batch's table."""

from __future__ import annotations

from ..sinks.output import space_needed
from ..sizes import counted, size_text


def summary(result) -> str:
    """A ``ConvertResult`` in one line, its tensors counted by kind as the plan counts them."""
    made = kinds_text(result.kinds) if result.kinds else f"{result.dequantized} dequantized"
    pushed = result.pushed
    return (
        f"{pushed.url if pushed else result.output}: {counted(result.tensors, 'tensor')} ({made}), "
        f"{result.bytes / 1e9:.2f} GB {result.made}, {result.seconds:.1f} s"
        + read_text(result.read)
        + (pushed_text(pushed) if pushed else "")
    )


def pushed_text(pushed) -> str:
    """What a push with no local copy (``hub.push.Pushed``) sent, and found on the Hub already, as a summary ends."""
    sent, found = (sum(size for _, size in files) for files in (pushed.uploaded, pushed.found))
    there = f", {counted(len(pushed.found), 'file')} ({size_text(found)}) on the Hub already" if pushed.found else ""
    return (
        f"; no local copy: {counted(len(pushed.uploaded), 'file')} ({size_text(sent)}) uploaded as made{there}, "
        f"{counted(pushed.committed, 'file')} in one commit"
    )


def read_text(read) -> str:
    """What a conversion read of a Hub SOURCE's weights (``hub.stream.StreamStats``), as the summary ends: streamed
    (fetched twice, where reads ran ahead of the hash) and read from the Hub cache; "" for a local SOURCE."""
    if read is None:
        return ""
    parts = []
    if read.fetched:
        again = f", {size_text(read.fetched_again)} of it twice" if read.fetched_again >= 1e6 else ""
        parts.append(f"{size_text(read.fetched)} streamed from the Hub{again}, no copy kept")
    if read.cached or not parts:
        parts.append(f"{size_text(read.cached)} read from the Hub cache")
    return "; " + ", ".join(parts)


def kinds_text(kinds: dict[str, int]) -> str:
    """Tensors per kind (``plan.Plan.kinds``): "11 copied, 20 dequantized from 4-bit, 9 merged with the adapter"."""
    return ", ".join(f"{count} {label}" for label, count in kinds.items())


def space_verdict(free: int, needed: int) -> str:
    """A dry run's word on the free space, by the conversion's own rule (the bytes and headroom)."""
    enough = free >= space_needed(needed)
    verdict = "enough" if enough else f"NOT enough: {size_text(space_needed(needed))} needed with headroom"
    return f"{size_text(free)} ({verdict})"


def plan_lines(prepared, on_disk: int | None = None) -> list[str]:
    """A dry run's plan (a ``conversion.Prepared``): source, output, tensors by kind, the output's layout as its sink
    says it, bytes, free space. ``on_disk``: pushed as it is made (no local copy), that many files on disk at once."""
    plan, sink = prepared.plan, prepared.sink
    needed = prepared.needed
    lines = [
        f"source: {_source(prepared)}",
        *([weights_line(*prepared.hub_weights)] if prepared.hub_weights else []),
        f"output: {prepared.output} ({sink.what(planned=True)})",
        f"tensors: {len(plan.tensors)} ({kinds_text(plan.kinds)})",
        *sink.plan_lines(),
    ]
    at_most = "" if sink.exact_size else "at most "
    if on_disk is None:
        free = space_verdict(prepared.free_bytes, needed)
        lines.append(f"to write: {at_most}{needed / 1e9:.3f} GB; free where it goes: {free}")
    else:
        disk = sink.delivered_disk(on_disk)
        how = f"{on_disk} shards at once" if sink.delivers else "the whole file, uploaded once written"
        lines.append(
            f"to upload: {at_most}{needed / 1e9:.3f} GB, with no local copy; local disk: at most {disk / 1e9:.3f} GB "
            f"({how}); free where it goes: {space_verdict(prepared.free_bytes, disk)}"
        )
    lines += [f"leftover: {leftover.note()}" for leftover in prepared.leftovers]
    lines.append("dry run: nothing was written")
    return lines


def weights_line(size: int, download: bool) -> str:
    """A dry run's word on the weights of a Hub SOURCE the Hub cache lacks: what a conversion fetches, and where."""
    if download:
        return f"weights: {size_text(size)} to download into the Hub cache first (--download), then read there"
    return f"weights: {size_text(size)} to stream from the Hub as they are converted; no copy kept on disk"


def _source(prepared) -> str:
    """A dry run's source: a Hub repo by its id and commit (read from the Hub, or from the Hub cache's copy), a local
    folder by its path."""
    from pathlib import Path

    from ..hub.names import commit_of, looks_like_repo_id

    if prepared.headers_only:
        return f"{prepared.headers_only} (its headers and quant states read from the Hub; no weights downloaded)"
    folder, base = prepared.plan.folder, prepared.base
    commit = commit_of(folder)
    if commit and looks_like_repo_id(base) and not Path(base).expanduser().exists():
        return f"{base}@{commit[:12]} (from the Hub cache: {folder})"
    return str(folder)


def table(rows) -> list[str]:
    """A batch's rows (``run.Row``) as an aligned table; where a row failed, its error in a last column."""
    errors = any(row.error for row in rows)
    header = ("source", "status", "output", "tensors", "size", "seconds") + (("error",) if errors else ())
    cells = [header] + [
        (
            row.source,
            row.status,
            row.output or "-",
            str(row.tensors or "-"),
            f"{row.bytes / 1e9:.2f} GB" if row.bytes is not None else "-",
            f"{row.seconds:.1f}" if row.seconds is not None else "-",
        )
        + ((row.error or "-",) if errors else ())
        for row in rows
    ]
    widths = [max(len(cell[i]) for cell in cells) for i in range(len(header))]
    return ["  ".join(value.ljust(width) for value, width in zip(cell, widths)).rstrip() for cell in cells]
