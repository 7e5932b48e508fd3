"""The run's loss, chosen once, and its normalisation by the step's count of counted targets.

:class:`RunLoss` is the one place where the loss is chosen, for training and validation alike:
under tensor parallelism the cross-entropy of the vocabulary-sharded logits inside
``loss_parallel``; with ``model.loss_chunks`` > 1 :class:`plugtrain.model.ChunkedLoss`, whose
full logits never exist; with a loss mask the sum over the counted targets (not ``-100``),
without one the mean over every target.

Every microbatch's loss is then normalised by the same number, the step's *count*: the targets
that count over every microbatch of the step on every one of the ``D`` data-parallel ranks,
divided by ``D``, since FSDP2 averages the gradients over those ranks. The step's gradient is
then that of the mean over all its counted targets, and the logged loss (the microbatches'
sum, averaged over ranks) that mean. Loss terms (``loss_terms``) receive the same count and the
mask, so that a term is normalised as the cross-entropy is.

Data without a loss mask (text) counts every target: the count is ``batch * seq_len / D``,
known without a collective, and the loss keeps the arithmetic it always had, each
microbatch's mean cross-entropy divided by the number of microbatches. With a loss mask (chat
data: only the assistant's tokens count), microbatches and ranks hold different numbers of
counted targets, and that average of means would weight a token of a microbatch with few of
them more than one of a microbatch with many (the gradient-accumulation bug of transformers PR
#34191, torchtune PR #1875). So each microbatch's loss is instead its *sum* over counted
targets times ``D / N``, ``N`` the count over the whole step: one all-reduce of a scalar per
step, on the device, with no read by the host. Under tensor parallelism the ``tp`` ranks of a
group read the same tokens and hold the same (replicated) loss: they are counted once, the
count summed over the data-parallel group only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from plugtrain.data import IGNORE_INDEX, MicroBatch
from plugtrain.distributed import ParallelDims
from plugtrain.errors import PluginError
from plugtrain.model import (
    ChunkedLoss,
    cross_entropy,
    parallel_cross_entropy,
    parallel_summed_cross_entropy,
    summed_cross_entropy,
)
from plugtrain.plugin import StepContext, StepLoss

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A loss of the logits and the targets: the mean cross-entropy, or the sum over counted ones."""


class RunLoss:
    """The run's loss, chosen once from the ``tp`` degree, ``model.loss_chunks`` and the data's
    loss mask, and each step's count (see the module doc). ``group``: the data-parallel ranks
    (``plugtrain.plugin.data_parallel_group``), None for one; needed with ``masked`` only."""

    def __init__(
        self, *, tp: int, chunks: int, masked: bool, group: dist.ProcessGroup | None = None
    ) -> None:
        self.chunks, self.masked, self.group = chunks, masked, group
        self.parallel: Callable[[], contextlib.AbstractContextManager[object]] = (
            loss_parallel if tp > 1 else contextlib.nullcontext
        )
        """The context the loss and its backward run in: ``loss_parallel`` under tensor
        parallelism, where the logits are sharded over the vocabulary; else nothing."""
        self._functions: dict[bool, LossFn] = (
            {False: parallel_cross_entropy, True: parallel_summed_cross_entropy}
            if tp > 1
            else {False: cross_entropy, True: summed_cross_entropy}
        )
        self.fn = self.function(masked)
        """The training loss of the logits; the model hooks may replace it (a compiler)."""
        self.count: torch.Tensor | float = 1.0
        """The current step's count: the normaliser of every microbatch's loss and terms."""
        self._weight: torch.Tensor | None = None

    def function(self, masked: bool) -> LossFn:
        """The cross-entropy of data with a loss mask (the sum over the counted targets) or
        without one (the mean), as the run computes it."""
        return self._functions[masked]

    def forward(
        self,
        model: torch.nn.Module,
        microbatch: MicroBatch,
        fn: LossFn | None = None,
        *,
        masked: bool | None = None,
        with_lse: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """``microbatch``'s logits, its loss (``fn`` of the logits, the training loss by
        default; ``masked`` data's is the sum over the counted targets) and, ``with_lse``, the
        logits' log-sum-exp for loss terms; in chunks no logits (None), and the loss and
        log-sum-exp of :class:`ChunkedLoss`. Call it inside :attr:`parallel`."""
        fn = self.fn if fn is None else fn
        masked = self.masked if masked is None else masked
        inputs, targets = microbatch.inputs, microbatch.targets
        if self.chunks == 1:
            logits = model(inputs, **microbatch.model_inputs())
            return logits, fn(logits, targets), None
        head = ChunkedLoss(targets, self.chunks, with_lse=with_lse, summed=masked)
        return None, *model(inputs, **microbatch.model_inputs(), head=head)

    def start(self, batch: Sequence[MicroBatch]) -> None:
        """Count the step's targets that count, over its microbatches and the data-parallel
        ranks: without a mask the local number of targets, with one an all-reduce."""
        if not self.masked:
            self.count = float(len(batch) * batch[0].targets.numel())
            return
        self.normalise([(microbatch.targets != IGNORE_INDEX).sum() for microbatch in batch])

    def normalise(self, counts: Sequence[torch.Tensor]) -> None:
        """Set the step's count from each microbatch's ``counts`` on this rank: their sum over
        the microbatches and the data-parallel ranks (one all-reduce, on the device)."""
        count = torch.stack(counts).sum().float()
        ranks = 1 if self.group is None else self.group.size()
        if ranks > 1:
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self.group)
        # A step with no counted target at all trains on nothing: count 1 keeps its loss 0.
        count = count.clamp(min=1)
        self._weight = ranks / count
        self.count = count / ranks

    def share(self, loss: torch.Tensor, num_microbatches: int) -> torch.Tensor:
        """This microbatch's share of the step's loss, of its cross-entropy ``loss``: the mean
        over its targets over the number of microbatches, or with a mask its sum over the
        counted ones over the count."""
        if not self.masked:
            return loss / num_microbatches
        assert self._weight is not None, "start() the step first"
        return loss * self._weight


class PluginLoss(RunLoss):
    """The loss one plugin answers (``build_loss``), in place of the cross-entropy: each
    microbatch's sum over its units (:class:`plugtrain.plugin.StepLoss`) normalised, as chat
    data's cross-entropy is by its counted targets, by the step's units over every microbatch
    and data-parallel rank of ``group``. Under tensor parallelism (``tp`` > 1) it runs, with
    its backward, inside ``loss_parallel``, as the cross-entropy does: the plugin's
    cross-entropy of the vocabulary-sharded logits reduces over the vocabulary there."""

    def __init__(
        self, name: str, answer: StepLoss, group: dist.ProcessGroup | None, tp: int = 1
    ) -> None:
        super().__init__(tp=tp, chunks=1, masked=True, group=group)
        self.name, self.answer = name, answer
        self.ctx: StepContext | None = None
        """The step the next microbatch belongs to (set by the step runner)."""

    @classmethod
    def of(
        cls, answers: Mapping[str, Any], group: dist.ProcessGroup | None, tp: int = 1
    ) -> PluginLoss | None:
        """The loss of ``build_loss``'s ``answers`` by plugin name, under ``tp``-way tensor
        parallelism; None if none answered, a :class:`PluginError` for two, or for an answer
        that is not a ``StepLoss``."""
        if len(answers) > 1:
            names = " and ".join(f"'{name}'" for name in answers)
            raise PluginError(f"plugins {names} both answer the loss: enable only one of them")
        if not answers:
            return None
        ((name, answer),) = answers.items()
        if not (callable(answer) and callable(getattr(answer, "units", None))):
            raise PluginError(
                f"plugin '{name}': build_loss returned a {type(answer).__name__}, not a "
                "StepLoss (a callable with a units(microbatch) method)"
            )
        return cls(name, answer, group, tp)

    def refuse_split(self, dims: ParallelDims) -> None:
        """Refuse, in one line, a layout where no rank runs whole sequences through the whole
        model, which the plugin's loss does: pipeline or context parallelism."""
        for key, degree, name in (("pp", dims.pp, "pipeline"), ("cp", dims.cp, "context")):
            if degree > 1:
                raise PluginError(
                    f"plugin '{self.name}' answers the loss, which does not run under {name} "
                    f"parallelism yet (parallelism.{key} = {degree}): set parallelism.{key} = 1"
                )

    def start(self, batch: Sequence[MicroBatch]) -> None:
        """Count the step's units, over its microbatches and the data-parallel ranks."""
        self.normalise([self.answer.units(microbatch) for microbatch in batch])

    def forward(
        self,
        model: torch.nn.Module,
        microbatch: MicroBatch,
        fn: LossFn | None = None,
        *,
        masked: bool | None = None,
        with_lse: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """No logits, the plugin's loss of ``microbatch`` (its sum over its units), no lse."""
        assert self.ctx is not None, "the step runner sets ctx"
        return None, self.answer(model, microbatch, self.ctx.microbatch), None
