"""Make a new plugin folder, ``plugins/<name>/``, from ``templates/plugin`` (CONTRIBUTING.md).

Usage, from the repository root::

    python scripts/new_plugin.py my_plugin
    python -m pip install -e plugins/my_plugin     # then enable it by name in a config

It copies the template, renaming ``template_plugin`` (the plugin and config section name),
``plugtrain_template_plugin`` (the import name), ``plugtrain-template-plugin`` (the
distribution), ``TemplatePlugin`` (the class) and ``TemplatePluginConfig`` (its config section)
after ``<name>``. That is the naming rule of every plugin: the class the entry point names is
the name in CamelCase (``grad_clip`` -> ``GradClip``), its config dataclass adds ``Config``;
it holds a torch class of the same name by its qualified name (``torch.amp.GradScaler``).
It also adds ``-e ./plugins/<name>`` to ``requirements-dev.txt`` at its place in
alphabetical order, so that the README set-up command installs it. The result passes the
tests as it is.

Everything a plugin is lives in its own folder; ``requirements-dev.txt`` is the one shared
line, merged with git's ``union`` driver (``.gitattributes``) so that two stacks adding
plugins never conflict there.
"""

from __future__ import annotations

import argparse
import keyword
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATE_NAME = "template_plugin"
NAME = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")
MAX_NAME = 32
"""Longer names would push the template's longest lines past the line length (100)."""
PLUGIN_LINE = re.compile(r"-e \./plugins/(?P<name>\S+)")


class NewPluginError(Exception):
    """A name or a repository state that cannot make a plugin: says what to do instead."""


def spellings(name: str) -> dict[str, str]:
    """Each spelling of the template's name mapped to the same spelling of ``name``."""
    return {
        "TemplatePlugin": "".join(part.capitalize() for part in name.split("_")),
        "template-plugin": name.replace("_", "-"),
        TEMPLATE_NAME: name,
    }


def check_name(name: str, plugins: Path) -> None:
    if not NAME.fullmatch(name) or keyword.iskeyword(name):
        raise NewPluginError(
            f"plugin name '{name}' must be lowercase words joined by '_' (like 'grad_clip')"
        )
    if len(name) > MAX_NAME:
        raise NewPluginError(f"plugin name '{name}' is longer than {MAX_NAME} characters")
    if (plugins / name).exists():
        raise NewPluginError(f"{plugins / name} already exists: choose another name")


def add_requirement(requirements: Path, name: str) -> None:
    """Insert ``-e ./plugins/<name>`` among the plugin lines, in alphabetical order."""
    lines = requirements.read_text().splitlines()
    new = f"-e ./plugins/{name}"
    plugin_rows = [i for i, line in enumerate(lines) if PLUGIN_LINE.fullmatch(line.strip())]
    after = [i for i in plugin_rows if PLUGIN_LINE.fullmatch(lines[i].strip())["name"] < name]
    where = (after[-1] + 1) if after else (plugin_rows[0] if plugin_rows else len(lines))
    lines.insert(where, new)
    requirements.write_text("\n".join(lines) + "\n")


def new_plugin(repo: Path, name: str) -> Path:
    """Create ``repo/plugins/<name>`` from ``repo/templates/plugin``; return its folder."""
    plugins = repo / "plugins"
    check_name(name, plugins)
    renames = spellings(name)

    def renamed(text: str) -> str:
        for old, new in renames.items():
            text = text.replace(old, new)
        return text

    template = repo / "templates" / "plugin"
    target = plugins / name
    for source in sorted(template.rglob("*")):
        if source.is_dir() or "__pycache__" in source.parts or source.suffix == ".pyc":
            continue
        destination = target / renamed(str(source.relative_to(template)))
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_text(renamed(source.read_text()))
    add_requirement(repo / "requirements-dev.txt", name)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("name", help="the plugin's name: lowercase words joined by '_'")
    args = parser.parse_args(argv)
    try:
        folder = new_plugin(REPO, args.name)
    except NewPluginError as error:
        print(f"new_plugin: error: {error}", file=sys.stderr)
        return 2
    print(f"created {folder.relative_to(REPO)} and added it to requirements-dev.txt; next:")
    print(f"  python -m pip install -e {folder.relative_to(REPO)}")
    print(f"  python -m pytest {folder.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
