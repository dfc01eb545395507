"""The tensor kinds, one module each: how a kind is planned (its recipe: sources, dtype, shape) and how its pieces
are produced. This registry is the one place that lists them; the reference each is checked against lives in
``verification/reference/`` under the same module name.

Adding a kind: a module here with a ``Recipe`` subclass (``kinds/base.py`` says what it answers), its entry below,
where the planner makes it (``plan.py``), and its reference in ``verification/reference/``.
"""

from __future__ import annotations

from .base import Recipe
from .copy import Copy
from .dequantize_4bit import Dequantize4bit
from .dequantize_8bit import Dequantize8bit
from .merge_lora import MergeLora
from .transpose import Transpose
from .untied import Untied

KINDS: dict[str, type[Recipe]] = {
    kind.kind: kind for kind in (Copy, Dequantize4bit, Dequantize8bit, Transpose, Untied, MergeLora)
}

__all__ = ["KINDS", "Recipe", "Copy", "Dequantize4bit", "Dequantize8bit", "Transpose", "Untied", "MergeLora"]
