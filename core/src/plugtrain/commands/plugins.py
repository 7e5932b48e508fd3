"""``plugtrain plugins``: every installed plugin, enabled or not, and the hooks it implements."""

from __future__ import annotations

import argparse

from plugtrain.config import enabled_plugins, merged_values, parse_command_line
from plugtrain.host import PluginHost, installed_plugins

__all__ = ["TAKES_CONFIG", "add_parser", "run"]

TAKES_CONFIG = True
"""Its arguments beyond its parser's are config options (``--plugins.enabled``), in
``args.config_args``."""


def add_parser(subparsers: argparse._SubParsersAction, summary: str) -> None:
    """``plugtrain plugins``'s parser, ``summary`` its line in ``plugtrain --help``."""
    subparsers.add_parser(
        "plugins",
        usage="plugtrain plugins [-h] [--config FILE] [--plugins.enabled NAMES]",
        help=summary,
        description="List every installed plugin: whether it is enabled, its distribution, "
        "version and hooks. Takes --config FILE and --plugins.enabled NAMES, as train.py does, "
        "to know which plugins are enabled; only those are imported. A name that several "
        "distributions provide gets one row per distribution, marked as clashing.",
    )


def run(args: argparse.Namespace) -> int:
    """Print every installed plugin: enabled or not, distribution, version, hooks.

    Only enabled plugins are imported (to list their hooks); the others are described from
    their distribution's metadata alone. A name that several distributions provide gets one
    row per distribution, marked as clashing, and none of them is imported.
    """
    enabled = enabled_plugins(merged_values(parse_command_line(args.config_args)))
    installed = installed_plugins()
    host = PluginHost()
    # A clashing name cannot be loaded; listing the clash is what this command is for.
    host.load_enabled([name for name in enabled if len(installed.get(name, ())) < 2])
    rows = [("plugin", "enabled", "distribution", "version", "hooks")]
    for name, providers in sorted(installed.items()):
        on = name in enabled
        for plugin in providers:
            if len(providers) > 1:
                others = ", ".join(f"'{p.distribution}'" for p in providers if p is not plugin)
                hooks = f"(clash: '{name}' is also provided by {others}; uninstall one)"
            elif on:
                hooks = ", ".join(host.hooks_of(name))
            else:
                hooks = f"(not loaded: {plugin.value})"
            rows.append((name, "yes" if on else "no", plugin.distribution, plugin.version, hooks))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[4])
    return 0
