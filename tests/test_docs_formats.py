"""The formats the command line's help and docs/cli.md name are the registry's: every registered format's family in
the help, its quant_method in the refusal's list, and an example of its name suffix in the default output's rule."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from nf4convert.cli.commands import main
from nf4convert.formats.base import all_formats, name_suffix

CLI_MD = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text(encoding="utf-8")


def _paragraph(starting: str) -> str:
    start = CLI_MD.index(starting)
    return CLI_MD[start : CLI_MD.index("\n- ", start + 1)]


def test_the_help_names_every_registered_family():
    text = " ".join(CliRunner().invoke(main, ["--help"], terminal_width=1000, max_content_width=1000).output.split())
    for name, source_format in all_formats().items():
        assert source_format.family in text, (name, source_format.family)


def test_the_quant_methods_docs_name_are_the_registrys():
    listed = _paragraph("A Hub repo's `config.json` is fetched first")
    listed = listed[listed.index("a `quant_method` other than") : listed.index(", 8-bit")]
    named = set(re.findall(r"`([a-z0-9-]+)`", listed))
    registered = {method for f in all_formats().values() for method in f.quant_methods}
    assert named == registered


def test_every_format_has_a_suffix_example_and_every_example_is_a_formats_suffix():
    rule = _paragraph("**OUT** defaults to").split("OUT may not be")[0]
    examples = re.findall(r"`-([A-Za-z0-9._-]+)`", rule)
    assert examples
    for example in examples:
        assert name_suffix().fullmatch(example.lower()) or name_suffix().search(f"model-{example}"), example
    for name, source_format in all_formats().items():
        own = re.compile(source_format.name_suffix, re.IGNORECASE)
        assert any(own.fullmatch(example) for example in examples), name
