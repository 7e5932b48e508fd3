"""``plugtrain train`` (and ``train.py``): a run from its command line, the Trainer's."""

from __future__ import annotations

import argparse
import os

from plugtrain.training import (
    check_world,
    configure,
    ends_quietly,
    launch_job,
    run_cli,
    split_launch_options,
)

__all__ = ["add_parser", "train"]


def add_parser(subparsers: argparse._SubParsersAction, summary: str) -> None:
    """``plugtrain train``'s entry in ``plugtrain --help``: its arguments go to :func:`train` as
    they are (argparse must neither read nor reorder them)."""
    subparsers.add_parser("train", add_help=False, help=summary)


def train(argv: list[str], prog: str = "train.py") -> int:
    """Run the training command line ``argv`` (``train.py``'s, ``plugtrain train``'s) and
    return its exit status; ``prog`` names the command in ``--help``."""

    def main() -> int | None:
        launch_args, args = split_launch_options(argv)
        if launch_args:  # --nproc-per-node N and the like: this process starts the job
            return launch_job(launch_args, args, prog)
        configured = configure(args, prog)
        if configured is None:  # --help
            return None
        # Here, not at the top: --help and a config error need no torch (seconds to import).
        from plugtrain.distributed import destroy_world
        from plugtrain.training import Trainer

        config, host = configured
        # Before the process group is up, where only rank 0 reports what every rank refuses.
        check_world(config, int(os.environ.get("WORLD_SIZE", "1")))
        Trainer(config, host).run()  # on an error, run_cli reports it and exits
        destroy_world()
        return None

    return ends_quietly(lambda: run_cli(main))
