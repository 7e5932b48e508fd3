"""The loader: the command line and the TOML file merged, built into ``JobConfig``; ``--help``.

The one loader of every section, the core's and the enabled plugins' alike: ``train.py`` and
``plugtrain train`` parse their arguments here (``training/launch.py``).
"""

from __future__ import annotations

import dataclasses
import textwrap
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plugtrain.config.job import CORE_SECTIONS, JobConfig
from plugtrain.config.reading import (
    LIST_SYNTAX,
    build_section,
    coerce,
    field_docs,
    help_type,
    section_doc,
)
from plugtrain.errors import ConfigError, did_you_mean


@dataclass
class CommandLine:
    """``train.py``'s arguments: a config file, ``--section.key value`` overrides, --help."""

    config_file: str | None = None
    overrides: dict[str, dict[str, str]] = field(default_factory=dict)
    help: bool = False


def parse_command_line(argv: list[str]) -> CommandLine:
    """Split ``argv`` into the config file and the ``--section.key value`` overrides."""
    cli = CommandLine()
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            cli.help = True
            continue
        if not arg.startswith("--"):
            raise ConfigError(
                f"unexpected argument {arg!r}: use --config FILE and --section.key VALUE"
            )
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if not args:
                raise ConfigError(f"argument '--{name}' needs a value: write --{name} VALUE")
            if args[0].startswith("--"):
                raise ConfigError(
                    f"argument '--{name}' needs a value, but '{args[0]}' follows it: write "
                    f"--{name}=VALUE for a value that starts with --"
                )
            value = args.pop(0)
        if name == "config":
            cli.config_file = value
            continue
        section, dot, key = name.partition(".")
        if not dot or not key:
            raise ConfigError(
                f"argument '--{name}' must be --section.key (e.g. --training.steps 50)"
            )
        cli.overrides.setdefault(section, {})[key] = value
    return cli


SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
"""The configs shipped with plugtrain (the repository's configs/ folder)."""


def config_file(path: str) -> Path:
    """``--config``'s file: ``path``, or for a bare name such as ``debug`` that is no file, the
    shipped config of that name (``configs/debug.toml``)."""
    p = Path(path)
    if p.is_file() or p.name != path or p.suffix:
        return p
    return SHIPPED_CONFIGS / f"{path}.toml"


def read_toml(path: str) -> dict[str, Any]:
    """Read a TOML config file, with one-line errors for a missing or malformed file."""
    p = config_file(path)
    if not p.is_file():
        shipped = ", ".join(sorted(c.stem for c in SHIPPED_CONFIGS.glob("*.toml")))
        raise ConfigError(
            f"config file '{path}' not found: pass an existing file to --config, or the name "
            f"of a shipped config ({shipped})"
        )
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from e
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(
                f"config file '{path}': top-level key '{section}' must be a [section] table"
            )
    return data


def merged_values(cli: CommandLine) -> dict[str, dict[str, Any]]:
    """The TOML file's sections with the command-line overrides applied on top."""
    values = read_toml(cli.config_file) if cli.config_file else {}
    for section, kv in cli.overrides.items():
        values.setdefault(section, {}).update(kv)
    return values


def enabled_plugins(values: dict[str, dict[str, Any]]) -> list[str]:
    """``plugins.enabled`` from the merged values, before the full config is built."""
    return coerce(values.get("plugins", {}).get("enabled", []), list[str], "plugins.enabled")


def build_config(
    values: dict[str, dict[str, Any]],
    plugin_sections: dict[str, type],
    installed: typing.Iterable[str] = (),
) -> JobConfig:
    """Build and validate the :class:`JobConfig` from merged values.

    ``plugin_sections`` maps each enabled plugin with a config section to its dataclass;
    ``installed`` names every installed plugin, to explain a section of a disabled one.
    """
    core = CORE_SECTIONS
    known = [*core, *plugin_sections]
    for section in values:
        if section in known:
            continue
        if section in installed:
            raise ConfigError(
                f"config section [{section}] configures plugin '{section}', which is not "
                f"enabled: add '{section}' to plugins.enabled or remove the section"
            )
        raise ConfigError(
            f"unknown config section [{section}]{did_you_mean(section, known)}; "
            f"sections: {', '.join(known)}"
        )
    return JobConfig(
        **{name: build_section(cls, name, values.get(name, {})) for name, cls in core.items()},
        plugin_sections={
            name: build_section(cls, name, values.get(name, {}))
            for name, cls in plugin_sections.items()
        },
    )


def _help_section(lines: list[str], section: str, cls: type) -> None:
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    if doc := section_doc(cls):
        lines.append(textwrap.fill(doc, 100, initial_indent="  ", subsequent_indent="  "))
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        lines.append(f"  --{section}.{f.name} ({help_type(f, hints[f.name])}; default {default!r})")
        if f.name in docs:
            lines.append(
                textwrap.fill(docs[f.name], 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
            )


def format_help(
    plugin_sections: dict[str, type],
    disabled_plugins: typing.Sequence[str] = (),
    prog: str = "train.py",
) -> str:
    """Every section and field with its type, default and docstring, for the command ``prog``.

    ``plugin_sections`` are the enabled plugins' sections; ``disabled_plugins`` names the
    installed plugins that are not enabled, whose sections the help only says how to see.
    """
    lines = [
        f"usage: {prog} [--config FILE] [--section.key VALUE ...]",
        "",
        "Every field can be set in the TOML file's [section] or overridden on the command line.",
        f"A list is written {LIST_SYNTAX}: --plugins.enabled grad_clip,ema.",
        "--config takes a TOML file, or the name of a config shipped with plugtrain: "
        + ", ".join(sorted(c.stem for c in SHIPPED_CONFIGS.glob("*.toml")))
        + ".",
        "--nproc-per-node N (and torchrun's other options) checks the config, then starts N "
        "processes (docs/parallelism.md).",
    ]
    sections = {**CORE_SECTIONS, **plugin_sections}
    for section, cls in sections.items():
        lines.append(f"\n[{section}]")
        _help_section(lines, section, cls)
    if disabled_plugins:
        names = ", ".join(disabled_plugins)
        lines.append("\n" + textwrap.fill(f"Installed plugins that are not enabled: {names}.", 100))
        lines.append(f"Their sections show once enabled: {prog} --plugins.enabled NAME,... --help")
    return "\n".join(lines)
