"""Validation: the loss and bits per byte on the validation data, per weight set, with hooks.

:class:`Validation` runs the passes that ``validation.interval`` asks for: the model's own
weights, then each weight set a plugin offers (``validation_weights``), each between
``pre_validation`` and ``post_validation``. Its forward is the training one (the run's
:class:`~plugtrain.training.loss.RunLoss`: masking, positions, chunks, tensor parallelism, and
the pipeline's schedule: ``StepRunner.evaluate``), so the loss of the same text is the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from plugtrain.config import JobConfig
from plugtrain.data import IGNORE_INDEX, MicroBatch, PackedDataset, Tokenizer, iter_eval_batches
from plugtrain.distributed import ParallelDims, all_reduce_mean
from plugtrain.host import PluginHost
from plugtrain.model import reshard
from plugtrain.observability import to_number
from plugtrain.plugin import ValidationContext
from plugtrain.training.loss import PluginLoss, RunLoss

if TYPE_CHECKING:
    from plugtrain.training.step import StepRunner


class Validation:
    """The validation passes of a run over ``data``, with its ``loss`` computed as ``step``
    computes the training one (on this rank's part of a row, through a pipeline), on this rank
    of ``dims``."""

    def __init__(
        self,
        config: JobConfig,
        model: torch.nn.Module,
        data: PackedDataset,
        loss: RunLoss,
        tokenizer: Tokenizer,
        host: PluginHost,
        dims: ParallelDims,
        step: StepRunner,
    ) -> None:
        self.config, self.model, self.data, self.loss = config, model, data, loss
        self.host, self.dims, self.step = host, dims, step
        self.token_bytes = torch.tensor(tokenizer.token_byte_lengths(), device=dims.device)
        """The UTF-8 bytes each token id stands for, for ``validation_bpb``."""
        self.answered = self.plugin_loss if isinstance(loss, PluginLoss) else None
        """The pass's loss when a plugin answers the run's (``build_loss``), else None."""

    def __call__(self, step: int) -> dict[str, float | str]:
        """The validation losses after ``step``: ``validation_loss`` and ``validation_bpb`` on
        the model's weights, then ``<name>/validation_loss`` and ``<name>/validation_bpb`` for
        each weight set a plugin offers (``validation_weights``), each pass between
        ``pre_validation`` and ``post_validation``; and what plugins report from
        ``validation_metrics`` (``<plugin>/<key>``, ``<name>/<plugin>/<key>`` for a weight
        set)."""
        hook = self.host.hook
        offered = self.host.results("validation_weights").values()
        losses: dict[str, float | str] = {}
        for weights in [None, *(name for names in offered for name in names)]:
            ctx = ValidationContext(step, weights)
            hook.pre_validation(ctx=ctx)
            ctx.loss, bpb = self.loss_and_bpb() if self.answered is None else self.answered()
            # While the pass's weights are in place, whatever order the plugins are in.
            metrics = self.host.results("validation_metrics", ctx=ctx)
            # FSDP2 keeps the root's and last block's parameters unsharded after a forward
            # without backward (this pass's, a plugin's): the next would reuse them, missing
            # the weights a plugin swaps in or back.
            reshard(self.model)
            hook.post_validation(ctx=ctx)
            prefix = "" if weights is None else f"{weights}/"
            losses[f"{prefix}validation_loss"] = ctx.loss
            if bpb is not None:
                losses[f"{prefix}validation_bpb"] = bpb
            for plugin, values in metrics.items():
                losses.update(
                    {
                        f"{prefix}{plugin}/{key}": v if isinstance(v, str) else to_number(v)
                        for key, v in values.items()
                    }
                )
        return losses

    @torch.no_grad()
    def plugin_loss(self) -> tuple[float, None]:
        """The loss a plugin answers (``build_loss``) over ``validation.steps`` batches: the
        mean over all their units on every rank, as in training; no bits per byte (its loss
        is not a likelihood of the text)."""
        assert isinstance(self.loss, PluginLoss)
        answer, total = self.loss.answer, torch.zeros(2, device=self.dims.device)
        self.model.eval()
        for index, microbatch in enumerate(self.batches()):
            microbatch = microbatch.to(self.dims.device)
            with self.loss.parallel():  # nothing without tensor parallelism
                loss = answer(self.model, microbatch, index)
            total += torch.stack([loss, answer.units(microbatch)])
        self.model.train()
        total = all_reduce_mean(total, self.dims.world_size)
        return (total[0] / total[1].clamp(min=1)).item(), None

    def batches(self) -> Iterator[MicroBatch]:
        """This rank's validation batches (under context parallelism its part of them)."""
        batches = iter_eval_batches(
            self.data,
            batch_size=self.config.training.batch_size,
            rank=self.dims.dp_rank,
            world_size=self.dims.dp_size,
            max_batches=self.config.validation.steps,
        )
        return (self.step.context_part(microbatch) for microbatch in batches)

    @torch.no_grad()
    def loss_and_bpb(self) -> tuple[float, float]:
        """Mean validation loss over ``validation.steps`` batches, averaged over ranks, and the
        bits per byte: the summed loss over ln 2 and the UTF-8 bytes the targets stand for.
        With a loss mask, the mean over the counted targets of all the batches and ranks."""
        device, masked = self.dims.device, self.data.loss_mask
        loss_fn = self.loss.function(masked)  # the training loss of this data, uncompiled
        self.model.eval()
        total = torch.zeros(2, device=device)  # the batches' mean losses, and their count
        scored = torch.zeros(2, dtype=torch.float64, device=device)  # nats, bytes
        for microbatch in self.batches():
            microbatch = microbatch.to(device)
            targets = microbatch.targets
            with self.loss.parallel():
                loss = self.step.evaluate(microbatch, loss_fn, masked)
            if masked:  # the loss over the counted tokens, as in training
                counted = targets != IGNORE_INDEX
                total[0] += loss
                total[1] += counted.sum()
                scored[0] += loss.double()
                scored[1] += (self.token_bytes[targets.clamp(min=0)] * counted).sum()
                continue
            total[0] += loss
            total[1] += 1
            scored[0] += loss.double() * targets.numel()
            scored[1] += self.token_bytes[targets].sum()
        self.model.train()
        # One reduction for both, in float64; rounded back to float32, the loss sums are those
        # of a float32 reduction (bitwise on 1 and 2 ranks: 53 bits >= 2 x 24 + 2).
        reduced = all_reduce_mean(torch.cat([total.double(), scored]), self.dims.world_size)
        total, (nats, num_bytes) = reduced[:2].float(), reduced[2:]
        bits_per_byte = nats / (math.log(2) * num_bytes)
        loss, bpb = torch.stack([(total[0] / total[1]).double(), bits_per_byte]).tolist()
        return loss, bpb  # one read of the device, as before
