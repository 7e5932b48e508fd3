"""The plugtrain command: look at the installed plugins and at finished runs.

  plugtrain plugins [--config FILE] [--plugins.enabled NAMES]  # installed plugins, their hooks
  plugtrain plot RUN_DIR [RUN_DIR ...] [-o metrics.png]        # draw and compare runs

Training runs through train.py: python train.py --help lists every config field.
"""

from __future__ import annotations

import argparse
import sys

from plugtrain.config import enabled_plugins, merged_values, parse_command_line
from plugtrain.host.plugin_host import PluginHost, installed_plugins
from plugtrain.observability.plot import plot_runs
from plugtrain.training.launch import run_cli


def list_plugins(config_args: list[str]) -> int:
    """Print every installed plugin: enabled or not, distribution, version, hooks.

    Only enabled plugins are imported (to list their hooks); the others are described from
    their distribution's metadata alone. A name that several distributions provide gets one
    row per distribution, marked as clashing, and none of them is imported.
    """
    enabled = enabled_plugins(merged_values(parse_command_line(config_args)))
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


def main(argv: list[str] | None = None) -> int:
    # Raw: the description's command lines must stay one per line, not be refilled.
    parser = argparse.ArgumentParser(
        prog="plugtrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "plugins",
        usage="plugtrain plugins [-h] [--config FILE] [--plugins.enabled NAMES]",
        help="list installed plugins and the hooks they implement",
        description="List every installed plugin: whether it is enabled, its distribution, "
        "version and hooks. Takes --config FILE and --plugins.enabled NAMES, as train.py does, "
        "to know which plugins are enabled; only those are imported. A name that several "
        "distributions provide gets one row per distribution, marked as clashing.",
    )
    plot = sub.add_parser(
        "plot",
        help="draw loss, grad_norm, loss_scale and throughput of one or several runs",
        description="Reads each run's metrics.jsonl; needs matplotlib (plugtrain[plot]).",
    )
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's dump folder")
    plot.add_argument("-o", "--output", default="metrics.png", help="image file (.png, .svg, .pdf)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "plot":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return run_cli(lambda: print(f"wrote {plot_runs(args.runs, args.output)}"))
    return run_cli(lambda: list_plugins(rest))


if __name__ == "__main__":
    sys.exit(main())
