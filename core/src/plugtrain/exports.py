"""Front doors: a package's public names, re-exported from its modules and imported on first use.

Each sub-package of plugtrain re-exports what other packages use
(``from plugtrain.host import PluginHost``), so that a module can move inside its package without
its users changing. The names are imported on first use rather than when the package is: the
light entry points (``plugtrain --help``, ``prepare-data``'s workers, the test kit's pytest
plugin) import one module of a package and must not pay for the rest of it, torch included.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def front_door(
    package: str, modules: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The ``__getattr__``, ``__dir__`` and ``__all__`` of package ``package``, which
    re-exports each name of ``modules`` (``{module: [name, ...]}``) from that module of it.

    ``tests/test_architecture.py`` reads the mapping to follow imports through the front door:
    pass it as a literal.
    """
    module_of = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *module_of})

    return __getattr__, __dir__, sorted(module_of)
