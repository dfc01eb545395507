"""What verify found: the report (tensors checked, what each was compared against, problems, notes) and its lines as
the command prints them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..sizes import counted


@dataclass
class VerifyReport:
    output: Path
    checked: int = 0
    dequantized: int = 0  # tensors recomputed by the reference libraries (not plain copies)
    merged: int = 0  # of which an adapter's change was merged by peft
    device: str = "cpu"
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # checks that could not run (not problems: the weights may be right)
    compared_against: dict[str, str] = field(default_factory=dict)  # tensor -> what it was compared against
    gguf: bool = False  # a GGUF file, checked against llama.cpp's converter run on the reference
    requantized: bool = False  # and that file made again by llama.cpp's own quantizer (llama-quantize's types)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def against(self) -> Counter:
        """How many tensors were compared against each reference ("bitsandbytes", "the source tensor", ...)."""
        return Counter(self.compared_against.values())

    @property
    def libraries(self) -> str:
        """What the recomputed tensors were compared against, together ("bitsandbytes and peft"; a GGUF's: "llama.cpp's
        converter on bitsandbytes", every tensor having gone through the converter)."""
        names = []
        for what in sorted(self.against):
            for part in what.split(" + "):
                if part != "the source tensor" and part not in names:
                    names.append(part)
        together = " and ".join(names) or "the source tensors"
        if self.requantized:
            return f"llama.cpp's converter and quantizer on {together}"
        return f"llama.cpp's converter on {together}" if self.gguf else together


def report_lines(report: VerifyReport) -> list[str]:
    """The report as the command prints it: what was compared against what, each problem, the verdict."""
    plain = {True: "its source tensor", False: "their source tensors"}  # a copy is compared with its source
    compared = ", ".join(
        f"{count} against {plain[count == 1] if what == 'the source tensor' else what}"
        for what, count in sorted(report.against.items())
    )
    if report.gguf:
        compared = f"{report.dequantized} recomputed by {report.libraries}"
    lines = [
        f"{report.output}: {counted(report.checked, 'tensor')} checked on {report.device}"
        + (f" ({compared})" if compared else "")
    ]
    lines += [f"  MISMATCH {problem}" for problem in report.problems[:20]]
    if len(report.problems) > 20:
        lines.append(f"  ... and {len(report.problems) - 20} more problems")
    lines += [f"  note: {note}" for note in report.notes]
    count = len(report.problems)
    lines.append(
        f"OK: bit-exact with {report.libraries}" if report.ok else f"FAILED: {count} problem{'s' if count != 1 else ''}"
    )
    return lines
