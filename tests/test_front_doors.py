"""The packages' front doors: what they declare for type checkers is what they serve at run time."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from plugtrain.exports import declared_names, front_door

CORE = Path(__file__).resolve().parents[1] / "core" / "src"
DOORS = sorted(
    ".".join(init.relative_to(CORE).parts[:-1])
    for init in CORE.glob("plugtrain/*/__init__.py")
    if "front_door(__name__, __file__)" in init.read_text()
)


def test_the_doors_are_found():
    assert {"plugtrain.model", "plugtrain.training", "plugtrain.testing"} <= set(DOORS)


@pytest.mark.parametrize("package", DOORS)
def test_each_declared_name_is_its_module_s_object(package):
    door = importlib.import_module(package)
    names = declared_names(package, door.__file__)
    assert door.__all__ == sorted(names)
    assert set(names) <= set(dir(door))
    wrong = [
        n for n in names if getattr(door, n) is not getattr(importlib.import_module(names[n]), n)
    ]
    assert wrong == []
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'nonesuch'"):
        door.nonesuch  # noqa: B018


def test_a_door_refuses_another_package_s_name(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from plugtrain.model.transformer import cross_entropy as cross_entropy\n"
    )
    with pytest.raises(ImportError, match=r"imports from 'plugtrain.model.transformer', outside"):
        front_door("plugtrain.training", str(init))
