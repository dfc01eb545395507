"""What a failed verify's findings suggest, said once beneath them: an output not made from that SOURCE, an adapter
merged in but not named, a GGUF converted with another ``--dtype``. Hints are notes: they never pass or fail a check."""

from __future__ import annotations

import re

MERGED_FRACTION = 10  # a weight with at least 1/10 of its elements (or bytes) changed looks merged, not damaged
_DIFFER = re.compile(r"^(\S+\.weight): (\d+) of (\d+) (?:elements|bytes) differ")

ADAPTER_HINT = (
    "the output looks merged with an adapter (weights of the source's dtype and shape, other values, or a head the "
    "tied source lacks); if it was, pass that adapter with --adapter"
)


def not_from_source(expected: dict[str, tuple], found: dict[str, tuple], problems: list[str]) -> str | None:
    """A note where the output is not the source's conversion at all (then the rest of the report is noise): most of
    its tensors are not the source's by name and shape, or most of the one-dimensional ones (norms, biases: copied by
    a conversion, left alone by an adapter) differ. ``expected``/``found``: tensor name -> shape."""
    common = [name for name in expected if found.get(name) == expected[name]]
    if expected and found and len(common) * 2 < min(len(expected), len(found)):
        return (
            f"only {len(common)} of the output's {len(found)} tensors are the source's by name and shape: this output "
            "was not made from that source"
        )
    flat = {name for name in common if len(expected[name]) == 1}
    differ = flat & {problem.split(": ", 1)[0] for problem in problems}
    if len(flat) >= 2 and len(differ) * 2 > len(flat):
        return (
            f"{len(differ)} of the {len(flat)} one-dimensional tensors (norms, biases: a conversion copies them, an "
            "adapter leaves them) differ: this output was not made from that source"
        )
    return None


def looks_merged(problems: list[str]) -> bool:
    """Whether the differences are those an adapter merge makes: weights of the right dtype and shape with a good
    part of their values changed (a merge changes most of a weight it targets; a flipped bit or a damaged block, a
    few), or a head written apart from the embeddings of a tied source (with its config untied)."""
    for problem in problems:
        if problem.startswith("lm_head.weight: in the output, not in the source"):
            return True
        differ = _DIFFER.match(problem)
        if differ and int(differ[2]) >= max(2, int(differ[3]) // MERGED_FRACTION):
            return True
    return False


def gguf_hints(problems: list[str], *, adapter_given: bool, dtype_given: bool) -> list[str]:
    """The notes for a GGUF whose weights differ widely: an adapter not named, or a --dtype not given."""
    if not looks_merged(problems):
        return []
    hints = [] if adapter_given else [ADAPTER_HINT]
    if not dtype_given:
        hints.append(
            "a GGUF's bytes depend on the dtype it was converted in: if it was made with a --dtype other than auto, "
            "pass that --dtype to verify"
        )
    return hints
