"""Skipping ranges of training batches: a wrapper around the loader, and the run's skip file.

Batches are numbered globally, 1 for the first the run draws, counting skipped ones: a number
means the same data on every rank and at any world size. :class:`SkippingLoader` wraps any
loader with ``next_batch``/``state_dict``/``load_state_dict`` and draws past the batches in its
ranges. Its state (in checkpoints, under ``data``) is the inner loader's, plus the count of
batches drawn and the ranges as a fixed-size tensor (checkpoints hold tensors only). A range
(:class:`SkipRange`) and a rewind (:class:`Rewind`) are what a plugin asks for through
``plugtrain.plugin.RunControl``, which re-exports both.

The ranges also live outside the checkpoints, in ``<job.dump_folder>/data_skips.json``, written
atomically before they take effect, with the rewind in progress if any: a rewind to a checkpoint
older than a range, or a restart after a kill at any moment, still skips every range and
finishes an interrupted rewind. On loading a state, ranges are merged, never dropped.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from plugtrain.errors import DataError, one_line


@dataclass(frozen=True)
class SkipRange:
    """Global batch numbers ``first`` to ``last`` (inclusive) that the data loader skips."""

    first: int
    last: int
    source: str
    """The plugin that asked for it ("" when only a checkpoint knows it)."""
    reason: str = ""


@dataclass(frozen=True)
class Rewind:
    """A rewind :meth:`plugtrain.plugin.RunControl.rewind` asked for at ``step``; after it is
    done, :attr:`~plugtrain.plugin.RunControl.rewinds` holds it with ``loaded_step`` and
    ``skipped`` filled in."""

    step: int
    """The step after which it was asked for."""
    to_step: int
    """Go back to the latest complete checkpoint at this step or earlier."""
    through_batch: int
    """Skip the batches after that checkpoint's through this global batch number."""
    source: str
    reason: str
    loaded_step: int = 0
    """The checkpoint's step it went back to (0 until done)."""
    skipped: SkipRange | None = None
    """The batches it skipped (None until done, or if none were left to skip)."""


SKIP_FILE = "data_skips.json"
"""The file of ``job.dump_folder`` that holds the run's skipped batch ranges."""
CAPACITY = 1024
"""Most ranges a run can skip (the checkpointed tensor has this many rows)."""
_KEYS = ("batches_drawn", "skip_ranges")


class BatchLoader(Protocol):
    def next_batch(self) -> Any: ...
    def peek(self) -> Any: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class SkippingLoader:
    """``inner``'s batches, but for those whose global number is in a skipped range."""

    def __init__(self, inner: BatchLoader, ranges: list[SkipRange]) -> None:
        self.inner = inner
        self.ranges = ranges
        """The ranges skipped (the run's :attr:`RunControl.skip_ranges`, shared)."""
        self.drawn = 0
        """Global batches drawn so far, skipped ones included: the last one's number."""

    def _skipped(self, number: int) -> bool:
        return any(r.first <= number <= r.last for r in self.ranges)

    def next_batch(self) -> Any:
        """The next batch not in a skipped range."""
        while self._skipped(self.drawn + 1):
            self.inner.next_batch()
            self.drawn += 1
        self.drawn += 1
        return self.inner.next_batch()

    def peek(self) -> Any:
        """The batch :meth:`next_batch` returns next, drawn now (the skipped ones before it are
        drawn too, as :meth:`next_batch` would have)."""
        while self._skipped(self.drawn + 1):
            self.inner.next_batch()
            self.drawn += 1
        return self.inner.peek()

    def prefetch(self) -> None:
        """Let the inner loader draw ahead, if it does (:class:`DevicePrefetcher`)."""
        prefetch = getattr(self.inner, "prefetch", None)
        if prefetch is not None:
            prefetch()

    def add(self, skip: SkipRange) -> None:
        """Skip ``skip`` too (its batches already drawn are not undone)."""
        if len(self.ranges) >= CAPACITY:
            raise DataError(
                f"more than {CAPACITY} skipped batch ranges: the data is not the problem; "
                f"see {SKIP_FILE} in job.dump_folder"
            )
        self.ranges.append(skip)

    def state_dict(self) -> dict[str, Any]:
        table = torch.zeros(CAPACITY, 2, dtype=torch.int64)
        for i, r in enumerate(self.ranges):
            table[i, 0], table[i, 1] = r.first, r.last
        return {**self.inner.state_dict(), "batches_drawn": self.drawn, "skip_ranges": table}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position; the checkpoint's ranges are added to those already known."""
        self.inner.load_state_dict({k: v for k, v in state_dict.items() if k not in _KEYS})
        self.drawn = int(state_dict["batches_drawn"])
        known = {(r.first, r.last) for r in self.ranges}
        for first, last in state_dict["skip_ranges"].tolist():
            if first and (first, last) not in known:
                self.add(SkipRange(first, last, source=""))


def read_skip_file(dump_folder: str | os.PathLike[str]) -> tuple[list[SkipRange], Rewind | None]:
    """The ranges and the unfinished rewind that ``data_skips.json`` holds (none if absent)."""
    path = Path(dump_folder) / SKIP_FILE
    try:
        data = json.loads(path.read_text())
        ranges = [SkipRange(**r) for r in data["ranges"]]
        rewind = Rewind(**data["rewind"]) if data["rewind"] else None
    except FileNotFoundError:
        return [], None
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise DataError(
            f"{path} is damaged ({one_line(e)}): fix it, or delete it to skip no batches"
        ) from e
    return ranges, rewind


def write_skip_file(
    dump_folder: str | os.PathLike[str], ranges: list[SkipRange], rewind: Rewind | None
) -> None:
    """Replace ``data_skips.json`` atomically (a crash leaves the old file or the new one)."""
    path = Path(dump_folder) / SKIP_FILE
    tmp = path.with_name(path.name + ".tmp")
    data = {"ranges": [asdict(r) for r in ranges], "rewind": asdict(rewind) if rewind else None}
    with tmp.open("w") as f:
        f.write(json.dumps(data, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
