"""From a command line to a configured run: config, plugins, and error reporting."""

from __future__ import annotations

import os
import select
import signal
import sys
import time
import traceback
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
from plugtrain.host import PluginHost, installed_plugins

RANK_0_FIRST_S = 10.0
"""How long a rank other than 0 that fails before the process group is up waits before it
exits, so that rank 0, which reports the failure, ends first."""


def configure(argv: list[str], prog: str = "train.py") -> tuple[JobConfig, PluginHost] | None:
    """Parse ``argv``, load the enabled plugins, build the config; None after ``--help``
    (whose usage line names the command ``prog``).

    Plugins are loaded before the config is validated, because each plugin's config section
    is the dataclass it declares through the ``config_section`` hook.
    """
    cli = parse_command_line(argv)
    values = merged_values(cli)
    host = PluginHost()
    host.load_enabled(enabled_plugins(values))
    sections = host.results("config_section")
    if cli.help:
        # Not the others' sections: importing a plugin means importing torch (seconds).
        disabled = sorted(set(installed_plugins()) - set(host.names()))
        print(format_help(sections, disabled, prog))
        return None
    return build_config(values, sections, installed_plugins()), host


def run_cli(main: Callable[[], int | None]) -> int:
    """Run ``main`` and return its exit status; report on stderr how it failed.

    A :class:`UserError` is one line and status 2; ``KeyboardInterrupt`` (a second Ctrl-C) one
    line and 130; any other error its traceback and 1. In a job of several processes, a failed
    process ends at once (``os._exit``), running no collective and waiting for no thread: the
    other ranks may be blocked in a collective it will never join, and so may its own
    background threads (an async checkpoint save). Its exit lets torchrun tear the group down.
    """
    try:
        return main() or 0
    except UserError as e:
        code, message = 2, f"error: {e}"
    except KeyboardInterrupt:
        code, message = 130, "interrupted (KeyboardInterrupt): stopped at once, without saving"
    except Exception as e:
        if isinstance(e, BrokenPipeError) and stdout_is_closed():
            raise  # the reader of our output left (| head): ends_quietly ends the command
        code, message = 1, ""
        traceback.print_exc()
    rank = int(os.environ.get("RANK", "0"))
    dist = sys.modules.get("torch.distributed")  # not imported: no group (and --help stays fast)
    in_group = dist is not None and dist.is_initialized() and dist.get_world_size() > 1
    # Bad input fails every rank alike before the group is up: rank 0's copy suffices. Once it
    # is up, a failure may be one rank's own, and that rank must say so.
    if message and (rank == 0 or in_group):
        prefix = f"[rank {rank}] " if rank else ""
        print(f"{prefix}plugtrain: {message}", file=sys.stderr)
    elif message and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun stops every rank once one exits: this silent rank must not be first, or
        # rank 0 is stopped before it says why. Rank 0 exits at once; torchrun ends this wait.
        time.sleep(RANK_0_FIRST_S)
    if in_group:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def stdout_is_closed() -> bool:
    """Whether standard output is a pipe or socket that nobody reads any more."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file: a test's capture, a closed stream
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def ends_quietly(main: Callable[[], int]) -> int:
    """Run a command's ``main`` and return its exit status; when the reader of its output
    leaves early (``plugtrain plugins | head``), end quietly with status 141, as a Unix tool
    that SIGPIPE kills does (128 + SIGPIPE), rather than print a traceback."""
    try:
        try:
            return main()
        finally:
            sys.stdout.flush()  # now, not at exit, where a failure prints a warning
    except BrokenPipeError:
        # Python flushes stdout once more at exit: devnull takes what is left.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
