"""``plugtrain estimate``: the memory each GPU needs to train a config, before any run."""

from __future__ import annotations

import argparse

from plugtrain.errors import ConfigError
from plugtrain.training import configure

__all__ = ["TAKES_CONFIG", "add_parser", "run"]

TAKES_CONFIG = True
"""Its arguments beyond its parser's are config overrides, in ``args.config_args``."""


def add_parser(subparsers: argparse._SubParsersAction, summary: str) -> None:
    """``plugtrain estimate``'s parser, ``summary`` its line in ``plugtrain --help``."""
    parser = subparsers.add_parser(
        "estimate",
        help=summary,
        description="Parameters, gradients, optimizer state, activations and logits per process "
        "for CONFIG on --gpus processes, with --section.key VALUE overrides as train.py takes "
        "them; under parallelism.pp, the pipeline rank that holds the most, each rank's total "
        "and the schedule's bubble. The formulas are in plugtrain/model/llama/memory.py and "
        "plugtrain/training/pipeline_plan.py.",
    )
    parser.add_argument("config", metavar="CONFIG", help="a TOML config")
    parser.add_argument("--gpus", type=int, default=1, help="processes in all (default 1)")
    parser.add_argument(
        "--tp", type=int, help="tensor-parallel degree (default: the config's parallelism.tp)"
    )


def run(args: argparse.Namespace) -> int:
    """Print the memory estimate of ``args.config`` (with its overrides) on ``args.gpus``."""
    from plugtrain.training import estimate_run  # lazy: only this command needs it

    if args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    if args.tp is not None and args.tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {args.tp}")
    tp = [] if args.tp is None else ["--parallelism.tp", str(args.tp)]
    configured = configure(["--config", args.config, *tp, *args.config_args])
    assert configured is not None  # no --help among the overrides: argparse took it
    print(estimate_run(configured[0], args.gpus, host=configured[1]).table())
    return 0
