"""What a Hub revision may be named: a git branch or tag name (git check-ref-format's rules), ``refs/pr/N``, or a commit
hash: the one rule for ``--revision`` (read from) and ``--push-branch`` (written to). A name past it could reach
huggingface_hub, which writes the revision's commit under ``refs/<revision>`` in its cache: a ``..`` there is a path
out of the cache."""

from __future__ import annotations

import re

COMMIT_SHA = re.compile(r"[0-9a-fA-F]{40}")
PULL_REQUEST = re.compile(r"refs/pr/\d+")
# What git (and so the Hub) refuses in a ref name (git check-ref-format): a control character, space, ~ ^ : ? * [ \,
# "..", "@{", "//", a part starting with "." or ending with ".lock", a name starting with "-" or "/", ending with
# "/" or ".", or HEAD.
BAD_REF = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//|(^|/)\.|\.lock(/|$)|^[-/]|[/.]$|^HEAD$")
LONGEST = 255  # bytes: a ref is a file name in git's (and the Hub cache's) refs folder


def ref_problem(name: str) -> str | None:
    """Why ``name`` cannot be a branch, tag or commit of a Hub repo, or None where it can."""
    if not isinstance(name, str) or not name:
        return "not a name git allows for a branch or tag (empty)"
    if len(name.encode("utf-8", "surrogatepass")) > LONGEST:
        return f"longer than {LONGEST} bytes"
    if COMMIT_SHA.fullmatch(name) or PULL_REQUEST.fullmatch(name):
        return None
    if BAD_REF.search(name):
        return "not a name git allows for a branch or tag"
    return None


def is_commit(name: str) -> bool:
    return bool(COMMIT_SHA.fullmatch(name))
