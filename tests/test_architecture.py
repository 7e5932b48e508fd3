"""The import graph: parts import downwards only, and plugins import the plugin API only.

Every import counts, including those under ``TYPE_CHECKING`` and inside functions: a cycle
hidden there is still a cycle a reader has to untangle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CORE = REPO / "core" / "src"
PLUGIN_API = {"plugtrain.plugin", "plugtrain.testing"}
"""The only core modules a plugin (or the plugin template) may import, in its code and its
tests (the kit's modules, ``plugtrain.testing.<module>``, count as the kit)."""
FLOORS = [
    ["plugtrain", "plugtrain.errors", "plugtrain.exports", "plugtrain.sample", "plugtrain.urls"],
    ["plugtrain.distributed"],
    ["plugtrain.model"],
    ["plugtrain.evaluation"],  # scores a model: needs the model only
    ["plugtrain.config"],
    ["plugtrain.data"],
    ["plugtrain.checkpoint"],
    ["plugtrain.plugin", "plugtrain.hookspecs"],  # the plugin API and the hook contract
    ["plugtrain.host"],
    ["plugtrain.observability"],
    ["plugtrain.training"],
    # The commands that load a saved model (eval loads through generate's loaders).
    ["plugtrain.commands.generate", "plugtrain.commands.eval"],
    # Entry points: the command, its table of sub-commands (train builds runs), the test kit.
    ["plugtrain.cli", "plugtrain.commands", "plugtrain.__main__", "plugtrain.testing"],
]
"""The core's layers, bottom-up: a module (or every module of a package) may import its own
floor and those below, never one above. The plugin API re-exports what plugins use from
the floors below it (``evaluation``'s scorer, the model's decoding loop); what it needs from
above (the exporter) the trainer hands in."""
TRAINER = "plugtrain.training.trainer"
"""The composition root: only entry points (train.py, the CLI) may import it."""
TRAINER_IMPORTERS = ["plugtrain.commands.train", "plugtrain.testing.runs"]
"""The core modules that may: the train command, and the test kit's runs (an entry point for
tests that builds runs)."""


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def front_doors(root: Path = CORE) -> dict[str, dict[str, str]]:
    """Each package's front door under ``root``, read as any re-export: the module that each
    name its ``__init__.py`` imports comes from (the imports under ``if TYPE_CHECKING:`` that
    ``plugtrain.exports.front_door`` serves at run time)."""
    doors = {}
    for init in root.rglob("__init__.py"):
        doors[module_name(init, root)] = {
            alias.asname or alias.name: node.module
            for node in ast.walk(ast.parse(init.read_text()))
            if isinstance(node, ast.ImportFrom) and node.module
            for alias in node.names
        }
    return doors


def imported_modules(
    path: Path, known: set[str], doors: Mapping[str, Mapping[str, str]] | None = None
) -> set[str]:
    """Every ``plugtrain`` module ``path`` imports, anywhere in the file; a name imported
    through a front door in ``doors`` counts as an import of the module that holds it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            door = (doors or {}).get(node.module, {})
            for a in node.names:
                # ``from plugtrain.observability import trace`` imports a module, not a name.
                if f"{node.module}.{a.name}" in known:
                    found.add(f"{node.module}.{a.name}")
                else:
                    found.add(door.get(a.name, node.module))
    return {name for name in found if name == "plugtrain" or name.startswith("plugtrain.")}


def core_graph(root: Path = CORE) -> dict[str, set[str]]:
    """Each module under ``root`` (the core's source folder) and the modules it imports."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    known, doors = set(paths), front_doors(root)
    return {name: imported_modules(path, known, doors) - {name} for name, path in paths.items()}


def find_cycle(graph: Mapping[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])):
                return cycle
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def floor_of(module: str, floors: list[list[str]]) -> int | None:
    """The index of the floor that names ``module`` or the package that holds it (``plugtrain``
    names the root module only, not the whole package), or None."""
    for index, floor in enumerate(floors):
        packages = [part for part in floor if part != "plugtrain"]
        if module in floor or any(module.startswith(f"{part}.") for part in packages):
            return index
    return None


def upward_imports(graph: Mapping[str, set[str]], floors: list[list[str]]) -> list[str]:
    """Each import of ``graph`` from a floor of ``floors`` to a higher one, in words."""
    found = []
    for module, imported in sorted(graph.items()):
        here = floor_of(module, floors)
        for target in sorted(imported):
            there = floor_of(target, floors)
            if here is not None and there is not None and there > here:
                found.append(f"{module} (floor {here}) imports {target} (floor {there})")
    return found


def layering_faults(root: Path, floors: list[list[str]]) -> list[str]:
    """What breaks the layering in the modules under ``root``, in words: each import up a
    floor of ``floors``, then an import cycle if there is one."""
    graph = core_graph(root)
    cycle = find_cycle(graph)
    return upward_imports(graph, floors) + (
        [f"import cycle: {' -> '.join(cycle)}"] if cycle else []
    )


def plugin_files() -> Iterator[Path]:
    """Every plugin's (and the template's) code and tests."""
    for plugin in [*REPO.glob("plugins/*"), REPO / "templates" / "plugin"]:
        for folder in ("src", "tests"):
            yield from (plugin / folder).rglob("*.py")


def outside_the_plugin_api(path: Path) -> list[str]:
    """The core modules ``path`` imports that a plugin may not."""
    imported = imported_modules(path, set()) - PLUGIN_API
    return sorted(name for name in imported if not name.startswith("plugtrain.testing."))


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


def test_every_core_module_has_a_floor():
    assert [name for name in sorted(core_graph()) if floor_of(name, FLOORS) is None] == []


def test_imports_run_down_the_floors_and_never_in_a_cycle():
    assert layering_faults(CORE, FLOORS) == []


def test_the_layering_check_fails_on_an_arrow_up_and_on_a_cycle(tmp_path):
    # A tree shaped like the core's, checked by the function the test above runs on the core.
    def write(files: dict[str, str]) -> None:
        for name, text in files.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)

    write(
        {
            "plugtrain/__init__.py": "",
            "plugtrain/errors.py": "",
            "plugtrain/model/__init__.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from plugtrain.model.memory import estimate\n"
            ),
            "plugtrain/model/memory.py": "from plugtrain.errors import ConfigError\n",
            "plugtrain/config/__init__.py": "from plugtrain.model import estimate\n",
            "plugtrain/data/__init__.py": "",
            "plugtrain/data/store.py": "from plugtrain.data import pipeline\n",
            "plugtrain/data/pipeline.py": "",
        }
    )
    assert layering_faults(tmp_path, FLOORS) == []
    # The model reads the config, inside a function; the config reaches the model through its
    # front door, so the arrow up also closes a cycle.
    write({"plugtrain/model/memory.py": "def f():\n    from plugtrain.config import JobConfig\n"})
    assert layering_faults(tmp_path, FLOORS) == [
        "plugtrain.model.memory (floor 2) imports plugtrain.config (floor 4)",
        "import cycle: plugtrain.config -> plugtrain.model.memory -> plugtrain.config",
    ]
    # A cycle within one floor: no arrow up, still a fault.
    write(
        {
            "plugtrain/model/memory.py": "",
            "plugtrain/data/pipeline.py": "from plugtrain.data.store import Store\n",
        }
    )
    assert layering_faults(tmp_path, FLOORS) == [
        "import cycle: plugtrain.data.pipeline -> plugtrain.data.store -> plugtrain.data.pipeline"
    ]


def test_an_import_up_is_reported_wherever_it_hides(tmp_path):
    # A module of the model floor importing the config under TYPE_CHECKING, and the checkpoint
    # code inside a function: both are found, by the same parser the real graph uses.
    module = tmp_path / "memory.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "from plugtrain.errors import ConfigError\n"
        "if TYPE_CHECKING:\n"
        "    from plugtrain.config import JobConfig\n"
        "def export():\n"
        "    from plugtrain.checkpoint import export_checkpoint\n"
    )
    graph = {"plugtrain.model.memory": imported_modules(module, set())}
    assert upward_imports(graph, FLOORS) == [
        "plugtrain.model.memory (floor 2) imports plugtrain.checkpoint (floor 6)",
        "plugtrain.model.memory (floor 2) imports plugtrain.config (floor 4)",
    ]
    assert upward_imports({"plugtrain.config": {"plugtrain.model"}}, FLOORS) == []


def test_only_entry_points_import_the_trainer():
    # The training package's front door re-exports it: that is not a use.
    importers = sorted(
        n for n, deps in core_graph().items() if TRAINER in deps and n != "plugtrain.training"
    )
    assert importers == TRAINER_IMPORTERS


def test_plugins_and_their_tests_import_only_the_plugin_api_and_the_kit():
    assert any("tests" in path.parts for path in plugin_files())
    offenders = {
        str(path.relative_to(REPO)): imported
        for path in plugin_files()
        if (imported := outside_the_plugin_api(path))
    }
    assert offenders == {}


@pytest.mark.parametrize("name", sorted(core_graph()))
def test_every_core_module_says_what_it_holds(name):
    path = next(p for p in CORE.rglob("*.py") if module_name(p, CORE) == name)
    docstring = ast.get_docstring(ast.parse(path.read_text()))
    assert docstring, f"{path} has no module docstring"
    assert docstring.splitlines()[0].endswith("."), f"{path}: the first line is not a sentence"


def docstrings(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        value = node.value if isinstance(node, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            yield value.value


def test_note_marks_only_rare_traps_and_never_a_docstring():
    sources = [*CORE.rglob("*.py"), *REPO.glob("plugins/*/**/*.py")]
    notes = sum(path.read_text().count("NOTE:") for path in sources)
    assert notes <= 13, f"{notes} NOTE: markers: keep them for traps a careful reader falls into"
    in_docstrings = [
        str(path.relative_to(REPO))
        for path in sources
        if any("NOTE:" in doc for doc in docstrings(ast.parse(path.read_text())))
    ]
    assert in_docstrings == []


def architecture_rows() -> dict[str, str]:
    """docs/architecture.md's table: each row's first cell (``plugin.py``, ``training/``) and
    the whole row's text."""
    rows = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        if line.startswith("| `"):
            for cell in line.split("|")[1].split(","):
                rows[cell.strip().strip("`")] = line
    return rows


def test_other_packages_enter_a_package_through_its_front_door():
    """``from plugtrain.host import PluginHost``, not ``plugtrain.host.plugin_host``, from
    outside ``host/``: a module can then move inside its package. A name that is also the name
    of one of the package's modules (``data.prepare.prepare``) cannot pass the front door."""
    offenders = []
    for path in CORE.rglob("*.py"):
        own = path.relative_to(CORE).parts[1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module):
                continue
            parts = node.module.split(".")
            if len(parts) != 3 or parts[0] != "plugtrain" or parts[1] == own:
                continue
            package = CORE / "plugtrain" / parts[1]
            shadowed = {a.name for a in node.names if (package / f"{a.name}.py").exists()}
            if {a.name for a in node.names} - shadowed:
                offenders.append(f"{path.relative_to(CORE)}: from {node.module} import ...")
    assert offenders == []


def test_the_architecture_doc_names_every_core_module():
    """Each module in its package's row (``training/``: ``trainer.py``), each top-level module
    and each package in a row of its own: the table cannot silently fall behind the tree."""
    rows = architecture_rows()
    missing = []
    for path in CORE.rglob("*.py"):
        parts = path.relative_to(CORE / "plugtrain").parts
        if parts == ("__init__.py",):
            continue
        if path.name == "__init__.py":
            named = f"{'/'.join(parts[:-1])}/" in rows
        elif len(parts) == 1:
            named = path.name in rows
        else:
            named = f"`{path.name}`" in rows.get(f"{'/'.join(parts[:-1])}/", "")
        if not named:
            missing.append("/".join(parts))
    assert sorted(missing) == []


def test_the_architecture_doc_names_every_cli_sub_command():
    from plugtrain.cli import COMMANDS

    assert len(COMMANDS) >= 4
    row = architecture_rows()["cli.py"]
    assert sorted(c for c in COMMANDS if f"`{c}`" not in row) == []


MAX_FUNCTION_LINES = 80
"""The longest a core function may be, docstring included: a step, a builder or a command
that outgrows a screen is split into named pieces."""
MAX_TRAINER_LINES = 450
"""The trainer is the loop (build order, schedule, checkpoints, metrics, stop); the model's
work, the data wiring and validation live in their own modules."""


def long_functions(root: Path, limit: int) -> list[str]:
    """``path:line name (N lines)`` for each function under ``root`` longer than ``limit``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    found.append(f"{where} {node.name} ({length} lines)")
    return found


def test_no_core_function_outgrows_a_screen():
    assert long_functions(CORE, MAX_FUNCTION_LINES) == []


def test_the_function_size_check_finds_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}")
    assert long_functions(tmp_path, MAX_FUNCTION_LINES) == [
        f"m.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"
    ]


def test_the_trainer_is_a_loop():
    trainer = CORE / "plugtrain" / "training" / "trainer.py"
    assert len(trainer.read_text().splitlines()) <= MAX_TRAINER_LINES
