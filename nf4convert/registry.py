"""Classes registered where they are defined and found by importing their package's modules: the source formats
(``formats/``), the tensor kinds (``kinds/``) and the output formats (``sinks/``) each keep one ``Registry``. Adding
one is adding its module; nothing lists them."""

from __future__ import annotations

import importlib
import pkgutil
from typing import TypeVar

Registered = TypeVar("Registered", bound=type)


class Registry(dict):
    """Name -> class, filled by ``register`` (a class decorator at the definition site); ``discovered()`` imports every
    module of ``package`` (subpackages too) once, which registers what they define."""

    def __init__(self, package: str, what: str, key: str, *, nested: bool = True):
        """``what``: how an error names one ("source format"); ``key``: the class attribute that is its name;
        ``nested``: its subpackages' modules are imported too."""
        super().__init__()
        self.package, self.what, self.key, self.nested = package, what, key, nested
        self._discovered = False

    def register(self, cls: Registered) -> Registered:
        name = getattr(cls, self.key)
        known = self.get(name)
        if known is not None and known is not cls:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self[name] = cls
        return cls

    def discovered(self) -> "Registry":
        if not self._discovered:
            package = importlib.import_module(self.package)
            walk = pkgutil.walk_packages if self.nested else pkgutil.iter_modules
            for module in walk(package.__path__, f"{self.package}."):
                importlib.import_module(module.name)
            self._discovered = True
        return self
