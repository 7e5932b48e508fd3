"""Crash injection for tests: a rank kills itself at a named point of a checkpoint save."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

FAULT_ENV = "PLUGTRAIN_CHECKPOINT_FAULT"
"""Test-only crash injection: comma-separated ``<point>:<step>:<rank>[:<marker file>]``. That
rank kills itself with SIGKILL at ``point`` (``after_step``, or ``before_commit``: its shard is
written, the checkpoint not yet made visible) of that step; with a marker file, only if the file
does not exist yet (it is created first), so that a restarted run does not crash again."""


@dataclass(frozen=True)
class Fault:
    """One crash that :data:`FAULT_ENV` asks this rank to simulate (tests only)."""

    point: str
    step: int
    marker: Path | None

    @staticmethod
    def from_env(rank: int) -> list[Fault]:
        faults = []
        for spec in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
            point, step, fault_rank, *marker = spec.split(":", 3)
            if point not in ("after_step", "before_commit"):
                raise ValueError(f"{FAULT_ENV}: unknown point {point!r}")
            if int(fault_rank) == rank:
                faults.append(Fault(point, int(step), Path(marker[0]) if marker else None))
        return faults

    def fire(self, point: str, step: int) -> None:
        if (point, step) != (self.point, self.step):
            return
        if self.marker is not None:
            if self.marker.exists():
                return
            self.marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)
