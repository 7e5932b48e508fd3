"""Front doors: a package's public names, imported for type checkers and lazily at run time.

Each sub-package of plugtrain re-exports what other packages use
(``from plugtrain.host import PluginHost``), so that a module can move inside its package without
its users changing. Its ``__init__.py`` declares the names once, as ordinary imports under
``if TYPE_CHECKING:`` (``from plugtrain.host.plugin_host import PluginHost as PluginHost``), which
type checkers and editors follow to the definitions; at run time :func:`front_door` reads that
block and imports each name on first use rather than when the package is: the light entry points
(``plugtrain --help``, ``prepare-data``'s workers, the test kit's pytest plugin) import one module
of a package and must not pay for the rest of it, torch included::

    from typing import TYPE_CHECKING

    if TYPE_CHECKING:
        from plugtrain.host.plugin_host import PluginHost as PluginHost
    else:
        from plugtrain.exports import front_door

        __getattr__, __dir__, __all__ = front_door(__name__, __file__)

The module ``__getattr__`` stays out of the type checkers' sight (the ``else``), so a name the
block does not declare is an error for them too.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def declared_names(package: str, init_file: str | Path) -> dict[str, str]:
    """The names the ``if TYPE_CHECKING:`` block of package ``package``'s ``init_file`` imports,
    each with the module of the package it comes from."""
    module_of = {}
    for node in ast.parse(Path(init_file).read_text(encoding="utf-8")).body:
        if not (isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"):
            continue
        for statement in node.body:
            if not isinstance(statement, ast.ImportFrom):
                continue
            module = statement.module or ""
            if statement.level or not module.startswith(f"{package}."):
                # Another package's name would leave by a second door.
                raise ImportError(
                    f"{init_file}: the front door imports from '{module}', outside {package}: "
                    f"re-export only {package}'s own modules"
                )
            module_of.update({alias.asname or alias.name: module for alias in statement.names})
    return module_of


def front_door(
    package: str, init_file: str
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The ``__getattr__``, ``__dir__`` and ``__all__`` of package ``package``, whose
    ``__init__.py`` is ``init_file``: each name of its ``if TYPE_CHECKING:`` imports
    (:func:`declared_names`), imported from its module when first asked for."""
    module_of = declared_names(package, init_file)

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *module_of})

    return __getattr__, __dir__, sorted(module_of)
