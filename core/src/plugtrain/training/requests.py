"""Carrying out the plugins' run requests (:class:`RunControl`): skipped batches and rewinds.

Order of a rewind, so that a kill at any moment restarts into the same run: a checkpoint save
in flight (async) is committed first; rank 0 writes ``data_skips.json`` with the rewind as
unfinished; every rank loads the checkpoint (later ones
are then deleted); the loaded data position gives the first batch to skip; rank 0 writes the
file again with the new range and no unfinished rewind. A restart that finds an unfinished
rewind in the file does it instead of the usual resume.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch.distributed as dist

from plugtrain.checkpoint import CheckpointManager
from plugtrain.data import SkippingLoader, read_skip_file, write_skip_file
from plugtrain.distributed import ParallelDims
from plugtrain.plugin import Rewind, RunControl, SkipRange

logger = logging.getLogger("plugtrain")


class RunRequests:
    """Applies a :class:`RunControl`'s requests to the data and the checkpoints, after a step."""

    def __init__(
        self,
        control: RunControl,
        batches: SkippingLoader,
        checkpointer: CheckpointManager,
        dump_folder: str | os.PathLike[str],
        dims: ParallelDims,
    ) -> None:
        self.control, self.batches, self.checkpointer = control, batches, checkpointer
        self.dump_folder, self.dims = dump_folder, dims
        ranges, self._unfinished = read_skip_file(dump_folder)
        for skip in ranges:
            batches.add(skip)

    def resume(self) -> None:
        """Resume as the checkpoint config says, or finish a rewind a kill interrupted."""
        if self._unfinished is None:
            self.checkpointer.load()
        else:
            logger.warning("finishing the rewind interrupted at step %d", self._unfinished.step)
            self._rewind(self._unfinished)

    def after_step(self) -> bool:
        """Apply the requests made during the step just taken (collective if a rewind); True
        if the run rewound."""
        control = self.control
        skips, control.requested_skips = control.requested_skips, []
        rewind, control.requested_rewind = control.requested_rewind, None
        for skip in skips:
            self.batches.add(skip)
            logger.warning("skipping batches %d-%d: %s", skip.first, skip.last, skip.reason)
        if rewind is not None:
            # Before the file records the rewind: a restart that finishes it must find the
            # checkpoints this process rewinds to, so the save in flight is committed first
            # (else a kill while it uploads sends the restart to an older one).
            self.checkpointer.wait()
            # A rewind with nothing to go to is refused here, never retried by a restart.
            self.checkpointer.latest_at_most(rewind.to_step)
        if skips or rewind is not None:
            self._write(rewind)
        if rewind is not None:
            self._rewind(rewind)
        return rewind is not None

    def _rewind(self, rewind: Rewind) -> None:
        loaded = self.checkpointer.rewind(rewind.to_step)
        first = self.batches.drawn + 1
        skip = None
        if rewind.through_batch >= first:
            skip = SkipRange(first, rewind.through_batch, rewind.source, rewind.reason)
            self.batches.add(skip)
        self.control.rewinds.append(dataclasses.replace(rewind, loaded_step=loaded, skipped=skip))
        self._write(None)
        logger.warning(
            "rewound from step %d to checkpoint step-%d for %s (%s), skipping batches %s",
            rewind.step,
            loaded,
            rewind.source,
            rewind.reason,
            f"{skip.first}-{skip.last}" if skip else "none",
        )

    def _write(self, unfinished: Rewind | None) -> None:
        if self.dims.is_main:
            write_skip_file(self.dump_folder, self.control.skip_ranges, unfinished)
        if self.dims.world_size > 1:
            # No rank loads or deletes a checkpoint before the file says what it is doing.
            dist.barrier()
