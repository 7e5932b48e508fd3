"""What a run says of itself besides its steps: its modes at start-up, its summary at the end.

The modes, also recorded in ``run.json`` (``setup``), are those no loss line shows: the
attention (causal, or masked to each document of a packed row, and the kernel that computes
it), the RoPE positions (running on across documents, or restarting at each), the parallel
layout (``dp_replicate x dp_shard x tp``, a pipeline's schedule, context parallelism), the
loss mask (every token, or the assistant's only) and the chat template (where it was read, and
its sha256, :attr:`ChatTemplate.sha256`). Document masking on data whose documents are longer
than a row changes nothing; the start-up says so from the first batch, which the run draws
anyway.

The summary says where the run ended (step, last and best validation loss), where its
checkpoint and metrics are, and the commands that use them, ready to paste. Rank 0 says it all.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from plugtrain.checkpoint import CheckpointManager
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
    setup = {
        "attention": config.model.attention,
        "attention_kernel": kernel,
        "positions": "per document" if config.data.reset_positions is True else "continuous",
        "layout": {name: dims.size(name) for name in LAYOUT},
        "loss_mask": "assistant" if loss_mask else "none",
        "chat_template": None if template is None else template.record(),
    }
    if dims.cp_enabled:
        setup["context"] = {"cp": dims.cp, "method": config.parallelism.cp_method}
    if dims.pp_enabled:
        setup["pipeline"] = {
            "pp": dims.pp,
            "schedule": config.parallelism.pp_schedule,
            "stages_per_rank": config.parallelism.stages_per_rank,
            "microbatches": config.training.grad_accum_steps,
        }
    return setup


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
    layout, besides = setup["layout"], ""  # the parallelism the layout's degrees leave out
    if "pipeline" in setup:  # the stages' ranks are outside the layout's
        pp = setup["pipeline"]
        besides = (
            f" in each of {pp['pp']} pipeline ranks ({pp['schedule']}, "
            f"{pp['stages_per_rank']} stage(s) per rank, {pp['microbatches']} microbatches)"
        )
    if "context" in setup:  # the cp ranks are inside dp_shard's
        cp = setup["context"]
        besides += f", each row split over {cp['cp']} context-parallel ranks ({cp['method']})"
    masked = setup["loss_mask"] == "assistant"
    loss = "the assistant's tokens only (data.chat_loss)" if masked else "every token"
    template = setup["chat_template"]
    named = (
        "none" if template is None else f"{template['origin']} (sha256 {template['sha256'][:12]})"
    )
    return [
        f"attention: {attention}; {positions}",
        f"layout: {' x '.join(str(layout[n]) for n in LAYOUT)} ({' x '.join(LAYOUT)}){besides}",
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


def validation_losses(metrics: Path) -> list[tuple[int, float]]:
    """The ``(step, validation_loss)`` records of the ``metrics.jsonl`` at ``metrics``, in order
    (none if it cannot be read)."""
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line a crash cut, that a resume would cut too
        if isinstance(record, dict) and "validation_loss" in record:
            records.append((record["step"], record["validation_loss"]))
    return records


def next_commands(config: JobConfig, chat: bool) -> list[str]:
    """The commands that use a run's checkpoint: generate, export-hf and eval, ready to paste
    (the paths quoted for the shell; with the run's ``checkpoint.endpoint_url``, its
    environment variable for botocore)."""
    run = shlex.quote(config.job.dump_folder)
    env = config.checkpoint.endpoint_url
    prefix = f"AWS_ENDPOINT_URL_S3={shlex.quote(env)} " if env else ""
    exported = shlex.quote(f"{config.job.records_folder.rstrip('/')}-hf")
    evaluation = config.plugin_sections.get("downstream_eval")  # the plugin's, read by name
    tasks = getattr(evaluation, "tasks", None) or ["sample:cloze.jsonl"]
    prompt = '--chat --prompt "Hello"' if chat else '--prompt "ROMEO:"'
    return [
        f"{prefix}plugtrain generate {run} {prompt}",
        f"{prefix}plugtrain export-hf {run} -o {exported}",
        f"{prefix}plugtrain eval {run} --tasks {' '.join(map(shlex.quote, tasks))}",
    ]


def summary_lines(
    config: JobConfig,
    step: int,
    losses: Sequence[tuple[int, float]],
    checkpoint: Path | str | None,
    metrics: Path,
    chat: bool,
) -> list[str]:
    """The lines that end a run of ``config`` at ``step``: its validation ``losses``
    (:func:`validation_losses`), its ``checkpoint`` (None: it saved none), its ``metrics``
    file and, with a checkpoint, the :func:`next_commands`."""
    where = f"step {step} of {config.training.steps}"
    finite = [(s, loss) for s, loss in losses if math.isfinite(loss)]
    if not losses:
        validation = "no validation loss (validation.interval is 0)"
    elif not finite:
        validation = f"validation loss {losses[-1][1]:.4f} at step {losses[-1][0]}"
    else:
        best = min(finite, key=lambda record: record[1])
        validation = (
            f"validation loss {losses[-1][1]:.4f} at step {losses[-1][0]}, best {best[1]:.4f} "
            f"at step {best[0]}"
        )
    lines = [f"run ends at {where}; {validation}"]
    if checkpoint is None:
        lines.append(
            f"metrics {metrics}; no checkpoint (checkpoint.save_final saves the last step, "
            "checkpoint.enable every checkpoint.interval steps and on a stop)"
        )
        return lines
    lines.append(f"checkpoint {checkpoint}; metrics {metrics}")
    return lines + [f"next: {command}" for command in next_commands(config, chat)]


class RunInfo:
    """The run's own description: its :attr:`setup`, for ``run.json``, its start-up lines and
    its summary. Built on every rank; only rank 0 speaks."""

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

    def finish(self, step: int, checkpoints: CheckpointManager, metrics: Path) -> None:
        """Sum the run up at ``step``: its validation losses (from ``metrics``, its
        ``metrics.jsonl``), the checkpoint it leaves (``checkpoints``' latest) and the commands
        that use it."""
        if not self.dims.is_main:
            return
        chat = self.setup["chat_template"] is not None
        losses = validation_losses(metrics)
        lines = summary_lines(self.config, step, losses, checkpoints.latest(), metrics, chat)
        for line in lines:
            logger.info("%s", line)
