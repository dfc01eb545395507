"""Every public error is exported at the top level, and README's list of them is the package's."""

from __future__ import annotations

import builtins
import inspect
import re
from pathlib import Path

import nf4convert
from nf4convert import errors

README = Path(__file__).resolve().parents[1] / "README.md"


def _public_errors() -> set[str]:
    return {
        name
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, errors.Nf4ConvertError) and not name.startswith("_")
    }


def test_every_error_class_is_exported_at_the_top_level():
    exported = set(nf4convert.__all__)
    assert _public_errors() <= exported, sorted(_public_errors() - exported)
    for name in _public_errors():
        assert getattr(nf4convert, name) is getattr(errors, name)


def test_readme_names_exactly_the_exported_errors():
    text = README.read_text(encoding="utf-8")
    paragraph = text[text.index("Every failure is an `nf4convert.Nf4ConvertError`") :].split("\n- ", 1)[0]
    named = {name for name in re.findall(r"`(?:nf4convert\.)?(\w+Error)`", paragraph) if not hasattr(builtins, name)}
    assert named == _public_errors(), (sorted(named - _public_errors()), sorted(_public_errors() - named))
