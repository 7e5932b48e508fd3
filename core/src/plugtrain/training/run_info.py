"""The modes a run trains in, named at start-up and recorded in ``run.json``.

They are those no loss line shows: the attention (causal, or masked to each document of a
packed row, and the kernel that computes it), the RoPE positions (running on across documents,
or restarting at each), the parallel layout (``dp_replicate x dp_shard x tp``), the loss mask
(every token, or the assistant's only) and the chat template (where it was read, and its
sha256, :attr:`ChatTemplate.sha256`). Document masking on data whose documents are longer
than a row changes nothing; the start-up says so from the first batch, which the run draws
anyway. Rank 0 says it all.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from plugtrain.config import JobConfig
from plugtrain.data import ChatTemplate, MicroBatch, MixtureDataset, PackedDataset, SkippingLoader
from plugtrain.distributed import ParallelDims

logger = logging.getLogger("plugtrain")

LAYOUT = ("dp_replicate", "dp_shard", "tp")
"""The parallel dimensions a run lays its ranks out on, outermost first (``ParallelDims``)."""


def run_setup(
    config: JobConfig, dims: ParallelDims, loss_mask: bool, template: ChatTemplate | None
) -> dict[str, Any]:
    """The modes of a run of ``config`` on ``dims``, as ``run.json`` records them (``setup``);
    ``loss_mask``: the loss counts the assistant's tokens only; ``template``: the chat template
    of its data (None for text, or one that cannot be told)."""
    document = config.model.attention == "document"
    if not document:
        kernel = "sdpa"
    else:  # see model/attention.py: flex attention has no backward on the CPU
        kernel = "flex attention" if dims.device.type == "cuda" else "sdpa, boolean mask"
    return {
        "attention": config.model.attention,
        "attention_kernel": kernel,
        "positions": "per document" if config.data.reset_positions is True else "continuous",
        "layout": {name: dims.size(name) for name in LAYOUT},
        "loss_mask": "assistant" if loss_mask else "none",
        "chat_template": None if template is None else template.record(),
    }


def setup_lines(setup: dict[str, Any]) -> list[str]:
    """The start-up lines that name the modes of :func:`run_setup`'s ``setup``."""
    if setup["attention"] == "document":
        attention = f"document masking ({setup['attention_kernel']})"
    else:
        attention = f"causal across packed documents ({setup['attention_kernel']})"
    if setup["positions"] == "per document":
        positions = "RoPE positions restart at each document"
    else:
        positions = "RoPE positions run on across documents"
    layout = setup["layout"]
    masked = setup["loss_mask"] == "assistant"
    loss = "the assistant's tokens only (data.chat_loss)" if masked else "every token"
    template = setup["chat_template"]
    named = (
        "none" if template is None else f"{template['origin']} (sha256 {template['sha256'][:12]})"
    )
    return [
        f"attention: {attention}; {positions}",
        f"layout: {' x '.join(str(layout[n]) for n in LAYOUT)} ({' x '.join(LAYOUT)})",
        f"loss on {loss}; chat template: {named}",
    ]


def boundary_note(what: str, batch: Sequence[MicroBatch], seq_len: int) -> str:
    """What ``what`` (document masking, per-document positions) does to ``batch``'s rows (a
    step's microbatches, with their documents or positions): how many rows hold more than one
    document, or that none does, so that nothing changes there."""
    crosses = torch.cat([_several_documents(microbatch) for microbatch in batch])
    if crosses.any():
        return (
            f"{what}: {int(crosses.sum())} of the first {len(crosses)} rows hold several documents"
        )
    return (
        f"{what}: none of the first {len(crosses)} rows crosses a document boundary, so "
        f"nothing changes there (the documents are long next to training.seq_len {seq_len})"
    )


def _several_documents(microbatch: MicroBatch) -> torch.Tensor:
    """Whether each row of ``microbatch`` holds more than one document."""
    if microbatch.documents is not None:  # numbered from 0 in each row
        return microbatch.documents[:, -1] > 0
    assert microbatch.positions is not None, "a run with neither documents nor positions"
    return (microbatch.positions[:, 1:] == 0).any(dim=1)  # restarting at each document


class RunInfo:
    """The run's own description: its :attr:`setup`, for ``run.json``, and its start-up lines.
    Built on every rank; only rank 0 speaks."""

    def __init__(
        self,
        config: JobConfig,
        dims: ParallelDims,
        train_data: PackedDataset | MixtureDataset,
        chat_template: ChatTemplate | None,
    ) -> None:
        self.config, self.dims = config, dims
        self.setup = run_setup(config, dims, train_data.loss_mask, chat_template)
        """The modes the run trains in (:func:`run_setup`)."""

    def start(self, batches: SkippingLoader) -> None:
        """Name the modes, and what document masking does to the first batch of ``batches``
        (drawn now, then trained on: nothing more is read)."""
        if not self.dims.is_main:
            return
        for line in setup_lines(self.setup):
            logger.info("%s", line)
        setup = self.setup
        on = [
            name
            for name, used in (
                ("document masking", setup["attention"] == "document"),
                ("per-document positions", setup["positions"] == "per document"),
            )
            if used
        ]
        if on:
            seq_len = self.config.training.seq_len
            logger.info("%s", boundary_note(" and ".join(on), batches.peek(), seq_len))
