"""``plugtrain plot``: one or several finished runs' metrics, drawn side by side."""

from __future__ import annotations

import argparse

from plugtrain.observability import plot_runs

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction, summary: str) -> None:
    """``plugtrain plot``'s parser, ``summary`` its line in ``plugtrain --help``."""
    parser = subparsers.add_parser(
        "plot",
        help=summary,
        description="Reads each run's metrics.jsonl; needs matplotlib (plugtrain[plot]).",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's dump folder")
    parser.add_argument(
        "-o",
        "--output",
        help="image file (.png, .svg, .pdf); default: metrics.png in the first run's folder",
    )


def run(args: argparse.Namespace) -> int:
    """Draw the runs and say where."""
    print(f"wrote {plot_runs(args.runs, args.output)}")
    return 0
