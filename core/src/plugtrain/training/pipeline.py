"""Pipeline parallelism: this rank's stages, their schedule, and a step's microbatches through it.

Under ``[parallelism] pp > 1`` each rank holds a part of the model (``ModelSpec.pipeline_split``:
its stages' blocks under the whole model's names) and runs its stages by a
``torch.distributed.pipelining`` schedule (``pp_schedule``), in place of the step's loop over
microbatches (``training.step.StepRunner.accumulate``). The step's microbatches
(``training.grad_accum_steps``) are concatenated and handed to the schedule whole, which splits
them back, the keyword inputs (``documents``, ``positions``) with them: each stage builds the
attention mask of its own microbatch (torchtitan #1723 built it before the split), and no
BlockMask crosses a stage (#3584).

The loss is the run's: the last stage computes each microbatch's share of the step's loss as
the loop does (``RunLoss.share``, the schedule scaling nothing), adds the loss terms and fires
``pre_backward`` (a loss scaler's scaling reaches the other stages through the gradients they
receive). The step's loss and terms are then summed over the ``pp`` group, so that every rank
holds what a run without a pipeline holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules

from plugtrain.config import JobConfig
from plugtrain.data import MicroBatch
from plugtrain.distributed import ParallelDims
from plugtrain.errors import ConfigError
from plugtrain.host import PluginHost
from plugtrain.model import ModelSpec, pipeline_stages
from plugtrain.plugin import StepContext
from plugtrain.training.loss import LossFn, RunLoss
from plugtrain.training.loss_terms import LossTerms
from plugtrain.training.pipeline_plan import check_microbatches, rank_stages

SCHEDULES = {
    "GPipe": schedules.ScheduleGPipe,
    "1F1B": schedules.Schedule1F1B,
    "Interleaved1F1B": schedules.ScheduleInterleaved1F1B,
    "ZBVZeroBubble": schedules.ScheduleZBVZeroBubble,
    "DualPipeV": schedules.ScheduleDualPipeV,
}
"""``parallelism.pp_schedule``'s names, and the schedule each stands for."""


def pipeline_placement(
    config: JobConfig, dims: ParallelDims, spec: ModelSpec
) -> tuple[int, tuple[int, ...]] | None:
    """The pipeline's stage count and this rank's stages (``model.build_model``'s
    ``pipeline``), None without one; refused in one line: a family that cannot be split, too
    few microbatches for the schedule, and what the pipeline cannot run yet."""
    parallelism = config.parallelism
    if not dims.pp_enabled:
        return None
    refusals = {
        "model.loss_chunks > 1": config.model.loss_chunks > 1,
        f"model.family = '{spec.name}'": spec.pipeline_split is None or spec.name == "moe",
    }
    for setting, refused in refusals.items():
        if refused:
            raise ConfigError(
                f"{setting} does not run under pipeline parallelism yet (parallelism.pp = "
                f"{dims.pp}): set parallelism.pp = 1, or change {setting.split(' ')[0]}"
            )
    schedule, pp, per_rank = parallelism.pp_schedule, dims.pp, parallelism.stages_per_rank
    check_microbatches(schedule, pp, per_rank, config.training.grad_accum_steps)
    return pp * per_rank, rank_stages(schedule, pp, per_rank, dims.rank_in("pp"))


class _StageShapes:
    """What each stage takes and returns for one microbatch of ``rows`` sequences of
    ``seq_len`` tokens, as meta tensors: the schedule then allocates its buffers from them
    instead of running a microbatch through every stage (and the loss) to find out. Under
    tensor parallelism (``tp`` ranks) the hidden states between stages are each rank's
    positions (sequence parallel), and the logits its share of the vocabulary."""

    def __init__(self, args: Any, rows: int, seq_len: int, dtype: torch.dtype, tp: int) -> None:
        self.args, self.rows, self.seq_len, self.dtype, self.tp = args, rows, seq_len, dtype, tp

    def hidden(self, rows: int, device: torch.device | str = "meta") -> torch.Tensor:
        """Hidden states of ``rows`` sequences, a stage's input: as a stage before sends them."""
        shape = (rows, self.seq_len // self.tp, self.args.dim)
        return torch.empty(shape, dtype=self.dtype, device=device)

    def inputs(self, index: int) -> torch.Tensor:
        """The tokens on the first stage, the hidden states elsewhere."""
        if index == 0:
            return torch.empty((self.rows, self.seq_len), dtype=torch.long, device="meta")
        # NOTE: a stage's floating-point input must require grad in its metadata, else the
        # schedule receives it without, and sends the stage before no gradient: silently.
        return self.hidden(self.rows).requires_grad_()

    def outputs(self, index: int, count: int) -> torch.Tensor:
        """The logits (this rank's vocabulary) on the last stage, the hidden states elsewhere."""
        if index < count - 1:
            return self.hidden(self.rows).requires_grad_()
        shape = (self.rows, self.seq_len, self.args.vocab_size // self.tp)
        return torch.empty(shape, dtype=self.dtype, device="meta", requires_grad=True)


class Pipeline:
    """A step body (``training.step.StepBody``) that runs the step's microbatches through this
    rank's stages of ``model`` by the schedule ``config.parallelism.pp_schedule`` names, with
    the run's ``loss`` and ``terms`` on the last stage (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        placement: tuple[int, Sequence[int]],
        config: JobConfig,
        dims: ParallelDims,
        loss: RunLoss,
        terms: LossTerms | None,
        host: PluginHost,
        param_dtype: torch.dtype,
    ) -> None:
        self.loss, self.terms, self.host = loss, terms, host
        self.count, indices = placement
        self.group = dims.get_mesh("pp").get_group()
        parallelism = config.parallelism
        self.holder = {
            index: rank
            for rank in range(dims.pp)
            for index in rank_stages(
                parallelism.pp_schedule, dims.pp, parallelism.stages_per_rank, rank
            )
        }
        """The rank of the ``pp`` group that holds each stage, by stage index."""
        self.microbatches = config.training.grad_accum_steps
        rows = config.training.batch_size // (dims.dp_size * self.microbatches)
        self.shapes = _StageShapes(model.args, rows, config.training.seq_len, param_dtype, dims.tp)
        self.modules = dict(zip(indices, pipeline_stages(model), strict=True))
        """This rank's stages by index."""
        stages = [
            PipelineStage(
                module, index, self.count, dims.device, self.shapes.inputs(index),
                self.shapes.outputs(index, self.count), group=self.group,
            )
            for index, module in self.modules.items()
        ]  # fmt: skip
        self.first, self.last = 0 in indices, self.count - 1 in indices
        """Whether this rank holds the first stage (it reads the tokens) and the last (its
        loss)."""
        schedule = SCHEDULES[config.parallelism.pp_schedule]
        runs = stages[0] if issubclass(schedule, schedules.PipelineScheduleSingle) else stages
        # The loss is each microbatch's share of the step's already: no scaling by the schedule.
        self.schedule = schedule(runs, self.microbatches, loss_fn=self._loss, scale_grads=False)
        self._step: StepContext | None = None
        self._sum = torch.zeros((), device=dims.device)
        self._term_names: list[str] | None = None

    def __call__(self, ctx: StepContext, batch: Sequence[MicroBatch]) -> torch.Tensor:
        """Forward and backward of ``batch`` through the schedule; returns the step's loss (the
        cross-entropy alone), the same on every rank of the pipeline."""
        self._step, ctx.microbatch = ctx, 0
        self._sum = torch.zeros((), device=self._sum.device)
        whole = MicroBatch.concatenate(batch)  # the schedule splits it into the microbatches
        args = (whole.inputs,) if self.first else ()
        target = whole.targets if self.last else None
        self.schedule.step(*args, target=target, **whole.model_inputs())
        self._step = None
        return self._share_step()

    @torch.no_grad()
    def evaluate(self, microbatch: MicroBatch, fn: LossFn) -> torch.Tensor:
        """``fn`` of ``microbatch``'s logits, the same on every rank of the pipeline: a forward
        of the whole batch through the stages in order, each sending its hidden states to the
        next one's rank (the training schedules' actions hold backward steps, and a batch
        without backward needs no microbatches)."""
        kwargs = microbatch.model_inputs()
        hidden = microbatch.inputs
        loss = torch.zeros((), device=self._sum.device)
        for index, stage in self.modules.items():
            if index > 0 and index - 1 not in self.modules:
                hidden = self.shapes.hidden(microbatch.inputs.shape[0], loss.device)
                dist.recv(hidden, group=self.group, group_src=self.holder[index - 1])
            hidden = stage(hidden, **kwargs)
            if index == self.count - 1:
                loss = fn(hidden, microbatch.targets)
            elif index + 1 not in self.modules:
                dist.send(hidden, group=self.group, group_dst=self.holder[index + 1])
        return self._reduce(loss)

    def _loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one microbatch on the last stage: its share of the step's
        loss with its terms, after which ``pre_backward`` fires."""
        ctx = self._step
        assert ctx is not None, "the loss of a step outside a step"
        loss = self.loss.share(self.loss.fn(output, targets), ctx.num_microbatches)
        self._sum += loss.detach()
        if self.terms is not None:
            terms_ctx = self.terms.context(ctx, output, targets, self.loss.count)
            loss = self.terms.added_to(loss, self.terms.answers(self.host, terms_ctx), ctx)
        ctx.loss = loss
        self.host.hook.pre_backward(ctx=ctx)
        ctx.microbatch += 1
        return ctx.loss

    def _share_step(self) -> torch.Tensor:
        """The step's loss and loss terms, from the last stage to every rank of the pipeline
        (one all-reduce); the terms' names are sent once, at the first step."""
        if self.terms is None:
            return self._reduce(self._sum)
        if self._term_names is None:
            names = [sorted(self.terms.sums) if self.last else None]
            dist.broadcast_object_list(
                names, group=self.group, group_src=self.holder[self.count - 1]
            )
            self._term_names = names[0]
        sums = self.terms.sums if self.last else {}
        zero = torch.zeros_like(self._sum)
        terms = [sums.get(name, zero) for name in self._term_names]
        values = self._reduce(torch.stack([self._sum, *terms]))
        self.terms.sums = dict(zip(self._term_names, values[1:], strict=True))
        return values[0]

    def _reduce(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over the ``pp`` group: the last stage's, on every rank."""
        value = value if self.last else torch.zeros_like(value)
        dist.all_reduce(value, group=self.group)
        return value
