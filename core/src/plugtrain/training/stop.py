"""Stopping a run cleanly on SIGTERM and SIGINT: at the end of a step, on every rank at once.

A signal only sets a flag; after each step the ranks vote (:meth:`StopSignals.vote`), so a
signal that reaches one rank stops every rank after the same step, and the run saves a
checkpoint (when checkpointing is on), closes its files and exits 0. The vote never makes a
step wait: each step starts an asynchronous all-reduce of the flags over a CPU (gloo) group
and reads the one started a step earlier, long finished, so a stop takes effect one step
after the signal, on every rank alike.

- SIGINT (Ctrl-C) is always handled: the first asks for the stop; it then gives the previous
  handler back, so a second Ctrl-C raises ``KeyboardInterrupt`` at once, without saving.
- SIGTERM (a scheduler's preemption notice) is handled only when checkpointing is on, where a
  stop saves the run; every SIGTERM only asks for the stop, since a scheduler or torchrun may
  send several. With nothing to save, its default action ends the process at once, which is
  also what torchrun counts on when it tears a failed group down.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


class StopSignals:
    """The stop flag, its signal handlers, and the per-step vote over ranks.

    Built on every rank (it makes a process group: a collective); :meth:`install` when training
    starts, :meth:`vote` after each step (collective), :meth:`close` at the end, on any path.
    """

    def __init__(self, world_size: int, *, sigterm: bool) -> None:
        self.signals = (signal.SIGINT, signal.SIGTERM) if sigterm else (signal.SIGINT,)
        self.requested: signal.Signals | None = None
        """The first signal this rank got, if any."""
        self._previous: dict[signal.Signals, Any] = {}
        # A CPU (gloo) group for the vote, whatever the training backend: a few bytes over
        # TCP per step, no device synchronisation.
        self._group = dist.new_group(backend="gloo") if world_size > 1 else None
        # The vote's buffer is read through numpy: it is host memory, never a device value.
        self._flags = np.zeros(1, dtype=np.int64)
        self._pending: dist.Work | None = None

    def install(self) -> None:
        """Handle the signals from now on (only the main thread can; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals:
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the step in progress finishes, then the vote stops every rank.
        if self.requested is None:
            self.requested = signal.Signals(signum)
        if signum == signal.SIGINT:
            self._restore(signal.SIGINT)
            # The second Ctrl-C stops at once, even in a process that inherited SIGINT
            # ignored (a launcher's or a test runner's child), whose previous handler is
            # SIG_IGN.
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def vote(self) -> signal.Signals | None:
        """The signal that stops the run after this step, if any rank had one a step ago.

        Collective: every rank calls it after every step. It waits only for the previous
        step's all-reduce, which has long finished, then starts this step's.
        """
        if self._group is None:
            return self.requested
        stop = None
        if self._pending is not None:
            self._pending.wait()
            stop = signal.Signals(int(self._flags[0])) if self._flags[0] else None
        self._flags[0] = int(self.requested or 0)
        self._pending = dist.all_reduce(
            torch.from_numpy(self._flags), op=dist.ReduceOp.MAX, group=self._group, async_op=True
        )
        return stop

    def close(self, *, wait: bool = True) -> None:
        """Give back the handlers :meth:`install` replaced, and with ``wait`` finish the vote in
        flight (every rank started it; after an error, a peer may never join: no wait)."""
        if wait and self._pending is not None:
            self._pending.wait()
        self._pending = None
        for signum in list(self._previous):
            self._restore(signum)

    def _restore(self, signum: signal.Signals) -> None:
        if signum in self._previous:
            previous = self._previous.pop(signum)
            # signal.signal returns None for a handler not set from Python.
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
