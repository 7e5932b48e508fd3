"""The model's work in a step: each microbatch's forward, loss, loss terms and backward.

The trainer's loop (schedule, optimizer, checkpoints, metrics, stop) hands each step's
microbatches to :meth:`StepRunner.forward_backward`, which counts the step's targets (the
loss's normaliser, ``training.loss``) and dispatches to a *body*, chosen in the constructor:
the microbatches one after another, accumulating their gradients (:meth:`StepRunner.accumulate`),
or under pipeline parallelism a schedule through this rank's stages
(``training.pipeline.Pipeline``), as torchtitan's ``forward_backward_step`` and OLMo-core's
train modules choose.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from plugtrain.data import MicroBatch
from plugtrain.errors import DataError, PluginError
from plugtrain.host import PluginHost
from plugtrain.model import model_spec, zigzag_indices
from plugtrain.model.moe.balance import Balance
from plugtrain.observability import StepTimer
from plugtrain.plugin import SetupContext, StepContext, data_parallel_group
from plugtrain.training.loss import LossFn, PluginLoss, RunLoss
from plugtrain.training.loss_terms import LossTerms
from plugtrain.training.pipeline import Pipeline, pipeline_placement

StepBody = Callable[[StepContext, Sequence[MicroBatch]], torch.Tensor]
"""A way to run a step's microbatches through the model: the step's loss on this rank."""


class StepRunner:
    """Runs a step's microbatches through ``model`` with the run's ``loss`` (or the one a
    plugin answers, ``build_loss``, fired here with the setup's ``ctx``) and the loss terms,
    firing the per-microbatch hooks; ``sync_replicas(last)`` says whether the next backward
    all-reduces across replicas. A model with experts is balanced by :attr:`balance`."""

    def __init__(
        self,
        model: torch.nn.Module,
        loss: RunLoss,
        host: PluginHost,
        ctx: SetupContext,
        sync_replicas: Callable[[bool], None],
        timer: StepTimer,
    ) -> None:
        self.model, self.host, self.hook = model, host, host.hook
        self.sync_replicas, self.timer = sync_replicas, timer
        dims = ctx.parallel_dims
        self.balance = Balance.of(
            model,
            ctx.config.model,
            ctx.config.metrics.moe_tokens_per_expert,
            data_parallel_group(dims) if dims.world_size > 1 else None,
        )
        """The load balancing of the model's mixture-of-experts layers; None without any."""
        if self.balance is not None:
            self.balance.attach(ctx.optimizer)  # the bias moves in the optimizer's step
        own = {"moe": self.balance.terms} if self.balance and self.balance.has_losses else {}
        self.loss_terms = LossTerms.of(host, own)
        """The loss terms, the plugins' and the core's own; None if none is on."""
        self.loss: RunLoss = plugin_loss(host, ctx, self.loss_terms) or loss
        """The training loss: the one plugin's that answers ``build_loss``, else the run's."""
        if isinstance(self.loss, PluginLoss):
            self.loss.refuse_split(dims)
        self.context = (dims.cp, dims.rank_in("cp")) if dims.cp_enabled else None
        """Under context parallelism, the ``cp`` degree and this rank's place in it."""
        self.pipeline: Pipeline | None = None
        """This rank's stages and their schedule, under pipeline parallelism; else None."""
        spec = model_spec(ctx.config.model.family)
        placement = pipeline_placement(ctx.config, dims, spec)
        if placement is not None:
            args = ctx.config, dims, self.loss, self.loss_terms, host, ctx.param_dtype
            self.pipeline = Pipeline(model, placement, *args)
        self.body: StepBody = self.accumulate if self.pipeline is None else self.pipeline
        """The body :meth:`forward_backward` runs: gradient accumulation over microbatches, or
        the pipeline's schedule."""

    def forward_backward(self, ctx: StepContext, batch: Sequence[MicroBatch]) -> torch.Tensor:
        """Forward and backward over ``batch``, the step's microbatches (under context
        parallelism this rank's part of their rows), by :attr:`body`; returns the step's loss
        on this rank (the cross-entropy alone, a tensor)."""
        batch = [self.context_part(microbatch) for microbatch in batch]
        if isinstance(self.loss, PluginLoss):
            self.loss.ctx = ctx
        self.loss.start(batch)
        with self.loss.parallel():  # nothing without tensor parallelism
            loss = self.body(ctx, batch)
        if self.balance is not None:
            self.balance.after_backward()
        return loss

    def evaluate(self, microbatch: MicroBatch, fn: LossFn, masked: bool) -> torch.Tensor:
        """Validation's loss ``fn`` of ``microbatch`` (for ``masked`` data its sum over the
        counted targets, else the mean; under context parallelism, of this rank's part of it:
        :meth:`context_part`), forward only, as training computes it: through the pipeline, if
        any."""
        if self.pipeline is not None:
            return self.pipeline.evaluate(microbatch, fn)
        return self.loss.forward(self.model, microbatch, fn, masked=masked)[1]

    def context_part(self, microbatch: MicroBatch) -> MicroBatch:
        """Under context parallelism this rank's part of ``microbatch`` (:func:`context_part`);
        else ``microbatch``. Every loss of a part counts its own targets: the step's count is
        summed over the ``cp`` ranks too (``plugtrain.plugin.data_parallel_group``)."""
        return microbatch if self.context is None else context_part(microbatch, *self.context)

    @property
    def states(self) -> dict[str, Balance]:
        """The step's own state to checkpoint, by name: the experts' balancing, if any."""
        return {} if self.balance is None else {"moe": self.balance}

    def metrics(self) -> dict[str, dict[str, torch.Tensor]]:
        """The step's own metrics of a logging step, as ``step_metrics``' answers are (by
        name: ``moe/...``, the experts' load)."""
        return {} if self.balance is None else {"moe": self.balance.metrics()}

    def accumulate(self, ctx: StepContext, batch: Sequence[MicroBatch]) -> torch.Tensor:
        """The microbatches one after another, each firing ``loss_terms`` (if implemented) and
        ``pre_backward`` between its forward and its backward; the gradients accumulate."""
        lap = self.timer.lap  # each lap ends a phase of the step: see StepTimer
        loss_sum = torch.zeros((), device=batch[0].targets.device)
        for ctx.microbatch, microbatch in enumerate(batch):
            with_lse = self.loss_terms is not None
            logits, loss, lse = self.loss.forward(self.model, microbatch, with_lse=with_lse)
            loss = self.loss.share(loss, ctx.num_microbatches)
            loss_sum += loss.detach()  # the logged loss: the cross-entropy alone
            if self.loss_terms is not None:  # only in runs where a plugin implements the hook
                router = self.balance.stats() if self.balance is not None else ()
                terms_ctx = self.loss_terms.context(
                    ctx, logits, microbatch.targets, self.loss.count, lse, router
                )
                terms = self.loss_terms.answers(self.host, terms_ctx)
                loss = self.loss_terms.added_to(loss, terms, ctx)
            del logits, lse  # freed before backward, as the graph keeps only what it needs
            ctx.loss = loss
            lap("fwd_bwd")
            self.hook.pre_backward(ctx=ctx)
            lap("hooks")
            self.sync_replicas(ctx.microbatch == ctx.num_microbatches - 1)
            ctx.loss.backward()
        return loss_sum


def context_part(microbatch: MicroBatch, cp: int, rank: int) -> MicroBatch:
    """Rank ``rank`` of ``cp``'s part of each of ``microbatch``'s rows
    (``model.context_parallel.zigzag_indices``), with each token's RoPE position (its place in
    the row, unless the microbatch has per-document ones)."""
    rows, seq = microbatch.inputs.shape
    device = microbatch.inputs.device
    positions = microbatch.positions
    if positions is None:
        positions = torch.arange(seq, dtype=torch.int32, device=device).expand(rows, seq)
    part = zigzag_indices(seq, cp, rank, device)
    documents = microbatch.documents
    return microbatch._replace(
        inputs=microbatch.inputs[:, part],
        targets=microbatch.targets[:, part],
        documents=None if documents is None else documents[:, part],
        positions=positions[:, part],
    )


def plugin_loss(host: PluginHost, ctx: SetupContext, terms: LossTerms | None) -> PluginLoss | None:
    """The loss a plugin answers through ``build_loss``, fired once with the setup's ``ctx``;
    None if none does. Loss terms, which add to the cross-entropy, are refused beside one."""
    answers = host.results("build_loss", ctx=ctx)
    if not answers:
        if ctx.data_kind == "preference":
            raise DataError(
                "the training data is preference pairs (chosen, rejected), but no enabled plugin "
                "answers their loss: enable the 'dpo' plugin (plugins.enabled)"
            )
        return None
    dims = ctx.parallel_dims
    group = None if dims.world_size == 1 else data_parallel_group(dims)
    loss = PluginLoss.of(answers, group, dims.tp)
    assert loss is not None
    if terms is not None:
        own = [f"model.{n}_*" for n in terms.own]  # the core's own: the moe losses
        adders = " and ".join([f"'{n}'" for n in host.implementers("loss_terms")] + own)
        raise PluginError(
            f"plugin '{loss.name}' answers the loss, so {adders} cannot add loss terms to the "
            "cross-entropy: enable one or the other"
        )
    return loss
