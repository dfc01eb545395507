"""What every kind of output verify checks answers, and the registry of them (as the sinks' is): verify asks the
registry which kind claims OUT, never which kinds there are. A kind is one class, registered where it is defined
(``@register``: a folder in ``folder.py``, a GGUF file in ``gguf.py``) and found by importing every module of this
package; adding one is adding its module here."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from ..registry import Registry


class Output:
    """An output verify checks: read, and its own checks made, when made (before SOURCE is fetched); then told the
    dtype SOURCE is planned in, and checked against the plan's references."""

    name: ClassVar[str]  # the registry's key
    default: ClassVar[bool] = False  # checks every OUT no other kind claims (the folder)
    gguf: ClassVar[bool] = False  # what the report says it checked
    imports: ClassVar[tuple[str, ...]] = ()  # what it imports beyond the reference libraries, begun on the side

    @staticmethod
    def claims(output: str) -> bool:
        """Whether OUT, as named, is of this kind."""
        return False

    def __init__(self, output: Path):
        raise NotImplementedError

    def plan_dtype(self, dtype):
        """The dtype SOURCE is planned in (a ``DType``; None: auto), given the ``dtype`` option (None: not given)."""
        raise NotImplementedError

    def check(self, report, plan, context, source_reader, device, *, progress: bool, source, revision, resolved):
        """Compare the output with the references of ``plan``'s tensors; what differs goes in ``report``."""
        raise NotImplementedError


OUTPUTS = Registry(__package__, "kind of verified output", "name", nested=False)
register = OUTPUTS.register  # class decorator: the kind joins the registry under its ``name``


def output_for(output: str) -> type[Output]:
    """The kind of output that claims OUT as named: the first that claims it by name, else the default (a folder)."""
    kinds = sorted(OUTPUTS.discovered().values(), key=lambda kind: (kind.default, kind.name))
    return next(kind for kind in kinds if kind.default or kind.claims(output))
