"""From a command line to a configured run: config, plugins, and error reporting."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from plugtrain.config import (
    JobConfig,
    build_config,
    enabled_plugins,
    format_help,
    merged_values,
    parse_command_line,
)
from plugtrain.errors import UserError
from plugtrain.host.plugin_host import PluginHost, installed_plugins


def configure(argv: list[str]) -> tuple[JobConfig, PluginHost] | None:
    """Parse ``argv``, load the enabled plugins, build the config; None after ``--help``.

    Plugins are loaded before the config is validated, because each plugin's config section
    is the dataclass it declares through the ``config_section`` hook.
    """
    cli = parse_command_line(argv)
    values = merged_values(cli)
    host = PluginHost()
    host.load_enabled(enabled_plugins(values))
    sections = host.call_each("config_section")
    if cli.help:
        print(format_help(sections))
        return None
    return build_config(values, sections, installed_plugins()), host


def run_cli(main: Callable[[], int | None]) -> int:
    """Run ``main``; a :class:`UserError` becomes one line on stderr and exit status 2."""
    try:
        return main() or 0
    except UserError as e:
        # Every rank fails the same way on bad input; one copy of the message suffices.
        if os.environ.get("RANK", "0") == "0":
            print(f"plugtrain: error: {e}", file=sys.stderr)
        return 2
