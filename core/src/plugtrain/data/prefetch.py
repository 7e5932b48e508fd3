"""Training batches on the device one step ahead: pinned memory, non-blocking copies.

On CUDA a plain ``tensor.to(device)`` from pageable memory makes the host wait for the copy;
from pinned memory with ``non_blocking=True`` it is queued like a kernel, so the host goes on
launching the step. The next batch is drawn and its copy queued right after the current step
is launched, while the device computes it. On the CPU the batches are used as they are.
"""

from __future__ import annotations

from typing import Any

import torch

from plugtrain.data.pipeline import MicroBatch, StatefulBatchLoader


class DevicePrefetcher:
    """Wraps a :class:`StatefulBatchLoader`: its batches, on ``device``, one step ahead.

    Its ``state_dict`` is the loader's position after the batches already handed out, not
    after the one prefetched, so that a checkpoint resumes with exactly the next batch.
    """

    def __init__(self, loader: StatefulBatchLoader, device: torch.device) -> None:
        self.loader, self.device = loader, device
        self._pin = device.type == "cuda"
        self._ahead: tuple[dict[str, Any], list[MicroBatch]] | None = None

    def next_batch(self) -> list[MicroBatch]:
        """The next step's microbatches on the device (copies possibly still in flight)."""
        if self._ahead is None:
            self.prefetch()
        assert self._ahead is not None
        batch, self._ahead = self._ahead[1], None
        return batch

    def prefetch(self) -> None:
        """Draw the next step's batch and queue its copy to the device."""
        if self._ahead is None:
            state = self.loader.state_dict()
            self._ahead = (state, [self._to_device(mb) for mb in self.loader.next_batch()])

    def peek(self) -> list[MicroBatch]:
        """The microbatches :meth:`next_batch` hands out next, drawn now if they are not yet."""
        self.prefetch()
        assert self._ahead is not None
        return self._ahead[1]

    def _to_device(self, microbatch: MicroBatch) -> MicroBatch:
        return microbatch.to(self.device, pin=self._pin)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict() if self._ahead is None else self._ahead[0]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)
        self._ahead = None
