"""Type checkers see every name of every front door, with its real type, not ``Any``."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from mypy import api

from plugtrain.exports import declared_names

CORE = Path(__file__).resolve().parents[1] / "core" / "src"
DOORS = sorted(
    ".".join(init.relative_to(CORE).parts[:-1])
    for init in CORE.glob("plugtrain/*/__init__.py")
    if "front_door(__name__, __file__)" in init.read_text()
)
CONFIG = """\
[mypy]
follow_imports = skip
no_implicit_reexport = True
[mypy-plugtrain.*]
follow_imports = silent
"""
"""plugtrain is read (its own errors are not reported); third-party packages are skipped, so
torch's types are Any and the check takes seconds."""


def public_names() -> dict[str, list[str]]:
    """Every name of every front door, and of the plugin API, by module."""
    names = {
        door: sorted(declared_names(door, CORE / door.replace(".", "/") / "__init__.py"))
        for door in DOORS
    }
    names["plugtrain.plugin"] = importlib.import_module("plugtrain.plugin").__all__
    return names


def probe() -> str:
    """A module that imports and uses every public name, then gets three things wrong."""
    lines, used = [], []
    for module, names in public_names().items():
        for name in names:
            alias = f"{module.replace('.', '_')}__{name}"
            lines.append(f"from {module} import {name} as {alias}")
            used.append(alias)
    lines += [
        f"used = [{', '.join(used)}]",
        "from plugtrain.training import Trainr",
        "from plugtrain.training import Trainer",
        "reveal_type(Trainer)",
        "wrong: Trainer = 1",
    ]
    return "\n".join(lines) + "\n"


@pytest.mark.slow  # about 10 s of CPU with no cache
def test_mypy_sees_every_public_name_and_its_type(tmp_path):
    (tmp_path / "mypy.ini").write_text(CONFIG)
    (tmp_path / "probe.py").write_text(probe())
    assert sum(len(names) for names in public_names().values()) > 100
    out, err, status = api.run(
        ["--config-file", str(tmp_path / "mypy.ini"), "--cache-dir", str(tmp_path / "cache"),
         "--no-error-summary", "--hide-error-context", str(tmp_path / "probe.py")]
    )  # fmt: skip
    assert err == ""
    lines = [line.split(": ", 1)[1] for line in out.splitlines()]
    assert len(lines) == 3, out  # nothing else: every other name was found
    assert lines[0] == (
        'error: Module "plugtrain.training" has no attribute "Trainr"; maybe "Trainer"?  '
        "[attr-defined]"
    )
    # The class itself, not Any: its constructor, whatever its arguments.
    assert lines[1].startswith('note: Revealed type is "def (config: ')
    assert lines[1].endswith(' -> plugtrain.training.trainer.Trainer"')
    assert lines[2] == (
        'error: Incompatible types in assignment (expression has type "int", variable has '
        'type "Trainer")  [assignment]'
    )
    assert status == 1
