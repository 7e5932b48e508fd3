"""``plugtrain train --nproc-per-node N``: check the config once, then start the processes.

torchrun starts the processes first: each meets a bad value, and torchrun then reports their
failure in a traceback of its own and exits 1. Here the config is built, and checked for the
job's world size as a run of that size would check it (``estimate_run``), before any process
starts: a bad value is one line and exit status 2. The processes then start through torch's
own launcher (``torch.distributed.run``, torchrun's code) with the torchrun options given; a
failed process's exit status is the command's, and torch's report of the failure is left out
(the process said what went wrong).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator

from plugtrain.config import JobConfig
from plugtrain.errors import ConfigError
from plugtrain.training.launch import configure

__all__ = [
    "LAUNCH_FLAGS",
    "LAUNCH_OPTIONS",
    "check_world",
    "exit_status",
    "launch_job",
    "split_launch_options",
]

LAUNCH_OPTIONS = (
    "nproc-per-node", "nnodes", "node-rank", "rdzv-backend", "rdzv-endpoint", "rdzv-id",
    "rdzv-conf", "max-restarts", "master-addr", "master-port", "log-dir", "redirects", "tee",
    "local-ranks-filter",
)  # fmt: skip
"""The torchrun options that ``plugtrain train`` hands to torch's launcher, each with a value
(``--name VALUE`` or ``--name=VALUE``; torchrun's spelling with ``_`` works too)."""
LAUNCH_FLAGS = ("standalone",)
"""The torchrun flags (no value) that ``plugtrain train`` hands to torch's launcher."""


def split_launch_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` split into torchrun's options (:data:`LAUNCH_OPTIONS`, :data:`LAUNCH_FLAGS`)
    and the rest, the run's own: config keys are dotted, so neither is taken for the other."""
    launch: list[str] = []
    rest: list[str] = []
    args: Iterator[str] = iter(argv)
    for arg in args:
        name, eq, _ = arg.removeprefix("--").partition("=")
        name = name.replace("_", "-")
        if not arg.startswith("--") or name not in (*LAUNCH_OPTIONS, *LAUNCH_FLAGS):
            rest.append(arg)
            continue
        launch.append(arg)
        if name in LAUNCH_OPTIONS and not eq:
            value = next(args, None)
            if value is None or value.startswith("--"):
                raise ConfigError(f"argument '--{name}' needs a value: write --{name} VALUE")
            launch.append(value)
    return launch, rest


def exit_status(exitcode: int) -> int:
    """A process's exit status as a shell reports it: a signal ``-N`` as ``128 + N``."""
    return 128 - exitcode if exitcode < 0 else exitcode


class _NoFailureReport(logging.Filter):
    """Leaves out torch's lines on a failure ("failed (exitcode: ...)", "Sending process ...
    closing signal"): the failed process said why, and the others stop as it did."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("failed (exitcode", "Sending process"))


def check_world(config: JobConfig, world_size: int) -> None:
    """Refuse in one line what a run of ``config`` on ``world_size`` processes would refuse once
    its process group is up (the degrees, the batch's split over the ranks, ``tp`` against the
    model's heads): checked before, every rank refuses it alike and rank 0 alone says so."""
    from plugtrain.training.estimate import estimate_run  # torch: not for a config error

    estimate_run(config, world_size)


def launch_job(launch_args: list[str], argv: list[str], prog: str) -> int:
    """Check the run ``argv`` asks for on the world ``launch_args`` (torchrun's options) give,
    then run it there as ``python -m plugtrain train ARGV``; return the job's exit status."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        raise ConfigError(
            f"{launch_args[0]} starts a job's processes, but torchrun already started this one "
            "as one of them: drop the torchrun options, or run plugtrain train without torchrun"
        )
    configured = configure(argv, prog)
    if configured is None:  # --help
        return 0
    # Here, not at the top: the config's errors above need no torch (seconds to import).
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from plugtrain.distributed import resolve_device

    parser = torchrun.get_args_parser()
    parser.exit_on_error = False
    try:
        args = parser.parse_args([*launch_args, "--module", "plugtrain", "train", *argv])
        min_nodes, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
        per_node = torchrun.determine_local_world_size(args.nproc_per_node)
    except (argparse.ArgumentError, ValueError, RuntimeError) as e:
        raise ConfigError(
            f"torchrun options '{' '.join(launch_args)}': {e}: see torchrun --help"
        ) from e
    config = configured[0]
    resolve_device(config.training.device)
    if min_nodes == max_nodes:  # an elastic job's size is known only once it runs
        check_world(config, max_nodes * per_node)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoFailureReport())
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = exit_status(failure.exitcode)
        if code != 2:  # 2: a user error, which the process reported in one line
            print(f"plugtrain: rank {rank} exited with status {code}", file=sys.stderr)
        return code
    except SignalException as e:  # torch's launcher stopped its processes on this signal
        return 128 + int(e.sigval)
    return 0
