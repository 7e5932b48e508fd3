"""plugtrain plugin: skip loss and gradient-norm spikes, and rewind past the data that causes them.

Each step, as an observer of the true gradients (``observe_gradients``), it compares the step's
global loss and total gradient norm with a rolling window of the last ``window`` accepted steps
(kept on the device), and vetoes the step (``pre_step``, a device flag: no host read) when a
value is not finite or a selected signal is above ``mean + sigma * std``. The window is updated
with accepted steps only.

Each step's verdict is kept in a small device buffer that the host reads on logging steps (and
every ``check_every`` steps if set), the moment it writes ``spike_guard.jsonl`` and decides a
rewind: after ``max_consecutive`` skips in a row, or one spike above ``rewind_sigma``, it asks the
run (``RunControl.rewind``) to go back to the latest checkpoint at least ``rewind_min_steps``
before the first bad step and skip the batches from there through the bad one, plus
``skip_margin``. A rewind therefore comes at most ``metrics.log_freq`` (or ``check_every``) steps
after the step that triggers it, on every rank at the same step. After ``max_rewinds`` rewinds
the run ends with a one-line error: the data is not the problem.

Under pipeline parallelism the loss reaches ``pre_backward`` on the last stage only: the step's
loss is summed over the stages (the others hold 0) and the norm is the whole model's, so every
rank tests the same values and vetoes the same steps.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plugtrain.plugin import (
    ParallelDims,
    PluginError,
    RunControl,
    SetupContext,
    StepContext,
    check_field,
    data_parallel_group,
    hookimpl,
    reduce_over_stages,
    total_norm,
)

__all__ = ["SpikeGuard", "SpikeGuardConfig"]

logger = logging.getLogger("plugtrain")

SIGNALS = ("loss", "grad_norm")
CAUSES = ("", "nonfinite", "spike", "big_spike")
"""Verdicts by code: 0 accepted, 1 loss or norm not finite, 2 spike, 3 spike above
``rewind_sigma``."""
EVENT_LOG = "spike_guard.jsonl"
# Columns of a step's record in the device buffer.
_CAUSE, _RUN, _VALUES, _MEAN, _STD = 0, 1, slice(2, 4), slice(4, 6), slice(6, 8)


@dataclass
class SpikeGuardConfig:
    """The ``[spike_guard]`` config section: what counts as a spike, and when to rewind."""

    signals: list[str] = field(default_factory=lambda: list(SIGNALS))
    """Which values are tested for spikes: ``loss`` (global mean loss of the step) and/or
    ``grad_norm`` (total L2 norm of the true gradients). Both are always tested for inf/nan."""
    window: int = 100
    """Accepted steps in the rolling window the mean and standard deviation are taken over
    (>= 2)."""
    sigma: float = 6.0
    """A value above ``mean + sigma * std`` of the window is a spike (> 0)."""
    warmup_steps: int = 100
    """Spike tests start once this many steps were accepted (at least 2); non-finite values are
    skipped from the first step."""
    max_consecutive: int = 5
    """Rewind after this many steps skipped in a row (0: never)."""
    rewind_sigma: float = 0.0
    """Rewind at once on a spike above ``mean + rewind_sigma * std`` (0: off; else > sigma)."""
    rewind_min_steps: int = 100
    """Rewind to a checkpoint at least this many steps before the first bad step (>= 1)."""
    skip_margin: int = 0
    """Batches skipped after the last bad one, on top of those from the checkpoint through it."""
    max_rewinds: int = 3
    """Rewinds before the run ends with an error (>= 1)."""
    check_every: int = 0
    """Also read the verdicts every this many steps (one host sync each); 0: on logging steps
    only (``metrics.log_freq``), which costs nothing more."""

    def __post_init__(self) -> None:
        check_field(
            bool(self.signals) and set(self.signals) <= set(SIGNALS),
            "signals",
            f"must be a non-empty list of {list(SIGNALS)}, got {self.signals}",
        )
        check_field(self.window >= 2, "window", f"must be >= 2, got {self.window}")
        check_field(0 < self.sigma < math.inf, "sigma", f"must be > 0, got {self.sigma}")
        check_field(
            self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}"
        )
        check_field(
            self.max_consecutive >= 0,
            "max_consecutive",
            f"must be >= 0 (0: never rewind), got {self.max_consecutive}",
        )
        check_field(
            self.rewind_sigma == 0 or self.rewind_sigma > self.sigma,
            "rewind_sigma",
            f"must be 0 (off) or > sigma = {self.sigma}, got {self.rewind_sigma}",
        )
        for key in ("rewind_min_steps", "max_rewinds"):
            check_field(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        check_field(self.skip_margin >= 0, "skip_margin", f"must be >= 0, got {self.skip_margin}")
        check_field(self.check_every >= 0, "check_every", f"must be >= 0, got {self.check_every}")

    @property
    def rewinds(self) -> bool:
        return self.max_consecutive > 0 or self.rewind_sigma > 0


class SpikeGuard:
    """Vetoes spiking steps on the device; rewinds, through the run's control, on the host."""

    def __init__(self) -> None:
        self.config = SpikeGuardConfig()
        self.name = "spike_guard"
        self.log_path: Path | None = None
        """The event log (rank 0 only)."""
        self._logged_rewinds = 0
        self._group: Any = None
        self._world_size = 1
        self._dims = ParallelDims()
        self._allocate(torch.device("cpu"), capacity=1)

    def _allocate(self, device: torch.device, capacity: int) -> None:
        cfg = self.config
        self.selected = torch.tensor([s in cfg.signals for s in SIGNALS], device=device)
        self.window = torch.zeros(cfg.window, len(SIGNALS), device=device)
        """The accepted steps' (loss, grad_norm), a ring buffer."""
        self.accepted = torch.zeros((), dtype=torch.int64, device=device)
        """Steps written into the window so far."""
        self.in_a_row = torch.zeros((), dtype=torch.int64, device=device)
        """Steps this plugin skipped in a row, up to the last one."""
        self.skipped = torch.zeros(len(CAUSES), dtype=torch.int64, device=device)
        """Steps skipped, by cause code."""
        self.records = torch.zeros(capacity, 8, device=device)
        """Each step's verdict since the last read, at ``step % capacity``: cause, skips in a
        row, loss, grad_norm, window means, window stds."""
        self.record_ids = torch.zeros(capacity, 2, dtype=torch.int64, device=device)
        """The step and global batch number of each record."""
        self.read_through = 0
        """The last step whose record the host has read."""
        self._loss = torch.zeros((), device=device)
        self._record = torch.zeros(8, device=device)
        self._veto = torch.zeros((), dtype=torch.bool, device=device)

    @hookimpl
    def config_section(self) -> type:
        return SpikeGuardConfig

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.name = ctx.name_of(self)
        self.config = cfg = ctx.plugin_config(self)
        if cfg.rewinds and not ctx.config.checkpoint.enable:
            raise PluginError(
                f"{self.name} rewinds to checkpoints (max_consecutive {cfg.max_consecutive}, "
                f"rewind_sigma {cfg.rewind_sigma}) but checkpoint.enable is off: enable "
                f"checkpoints, or set {self.name}.max_consecutive = 0 and rewind_sigma = 0"
            )
        # Its skips show in the core's skipped_steps; the window's statistics are internals.
        ctx.show_on_console(self, "rewinds", nonzero=True)
        log_freq = ctx.config.metrics.log_freq
        self._allocate(ctx.device, min(log_freq, cfg.check_every or log_freq))
        # The ranks that train on different data: the world without tensor parallelism.
        self._dims = ctx.parallel_dims
        self._world_size = ctx.parallel_dims.dp_size
        if self._world_size > 1:
            self._group = data_parallel_group(ctx.parallel_dims)  # each rank's loss is its own
        if ctx.parallel_dims.is_main:
            self.log_path = Path(ctx.config.job.records_folder) / EVENT_LOG
            # A step is tested once the steps before it filled the warmup.
            warmup, steps = max(cfg.warmup_steps, 2), ctx.config.training.steps
            if warmup >= steps:
                logger.warning(
                    "%s: no step is tested for spikes within training.steps = %d (the tests "
                    "start after %d accepted steps; non-finite values are still skipped): "
                    "lower %s.warmup_steps",
                    self.name,
                    steps,
                    warmup,
                    self.name,
                )

    @hookimpl(wrapper=True)
    def pre_backward(self, ctx: StepContext) -> Any:
        # A wrapper: it sees the loss before any plain implementation (a loss scaler) scales it.
        assert ctx.loss is not None
        if ctx.microbatch == 0:
            self._loss.zero_()
        self._loss += ctx.loss.detach()
        return (yield)

    @hookimpl
    def observe_gradients(self, ctx: StepContext) -> None:
        self._log_rewinds(ctx.control)
        loss = self._loss
        if self._world_size > 1:
            dist.all_reduce(loss, group=self._group)
            loss /= self._world_size
        if self._dims.pp_enabled:  # a copy: the stages before the last keep their 0
            loss = reduce_over_stages(loss.clone(), self._dims, dist.ReduceOp.SUM)
        values = torch.stack([loss.float(), total_norm(ctx.gradients(), dims=self._dims)])
        cfg = self.config
        n = self.accepted.clamp(max=cfg.window)
        filled = (torch.arange(cfg.window, device=n.device) < n).unsqueeze(1)
        mean = (self.window * filled).sum(0) / n.clamp(min=1)
        std = ((((self.window - mean) * filled) ** 2).sum(0) / (n - 1).clamp(min=1)).sqrt()
        finite = values.isfinite().all()
        warm = self.accepted >= max(cfg.warmup_steps, 2)
        spike = warm & finite & ((values > mean + cfg.sigma * std) & self.selected).any()
        cause = spike.long() * 2
        if cfg.rewind_sigma > 0:
            big = spike & ((values > mean + cfg.rewind_sigma * std) & self.selected).any()
            cause += big.long()
        if ctx.loss_scaler is None:  # else non-finite gradients are the scaler's to skip
            cause = torch.where(finite, cause, 1)
        self._veto = cause > 0
        self._record = torch.cat([cause.float().view(1), self.in_a_row.view(1), values, mean, std])

    @hookimpl
    def pre_step(self) -> torch.Tensor:
        return self._veto

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        assert ctx.skipped is not None
        accepted = ctx.skipped.logical_not()
        slot = (self.accepted % self.config.window).view(1)
        values = self._record[_VALUES]
        kept = torch.where(accepted, values, self.window.index_select(0, slot)[0])
        self.window.index_copy_(0, slot, kept.view(1, -1))
        self.accepted += accepted.long()
        self.in_a_row.copy_(torch.where(self._veto, self.in_a_row + 1, 0))
        self.skipped.index_add_(0, self._record[_CAUSE].long().view(1), self._veto.long().view(1))
        row = ctx.step % len(self.records)
        self._record[_RUN] = self.in_a_row
        self.records[row] = self._record
        self.record_ids[row, 0].fill_(ctx.step)
        self.record_ids[row, 1].fill_(ctx.batch)
        if self.config.check_every and ctx.step % self.config.check_every == 0:
            self._read(ctx.step, ctx.control)

    @hookimpl
    def step_metrics(self, ctx: StepContext) -> dict[str, Any]:
        self._read(ctx.step, ctx.control)
        metrics: dict[str, Any] = {
            f"skipped.{cause}": self.skipped[code] for code, cause in enumerate(CAUSES) if code
        }
        metrics["rewinds"] = len(self._own_ranges(ctx.control))
        for i, signal in enumerate(SIGNALS):
            metrics[f"window_mean.{signal}"] = self._record[_MEAN][i]
            metrics[f"window_std.{signal}"] = self._record[_STD][i]
        return metrics

    @hookimpl
    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "accepted": self.accepted,
            "in_a_row": self.in_a_row,
            "skipped": self.skipped,
            "records": self.records,
            "record_ids": self.record_ids,
            "read_through": self.read_through,
        }

    @hookimpl
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict.items():
            if key == "read_through":
                self.read_through = int(value)
            elif getattr(self, key) is not value:
                getattr(self, key).copy_(value)

    # ----------------------------------------------------------------------- on the host

    def _own_ranges(self, control: RunControl) -> list[Any]:
        return [r for r in control.skip_ranges if r.source == self.name]

    def _read(self, step: int, control: RunControl) -> None:
        """Read the verdicts since the last read (a host sync); log skips; maybe rewind."""
        ids, records = self.record_ids.tolist(), self.records.tolist()
        new = sorted(
            (s, b, r) for (s, b), r in zip(ids, records, strict=True) if self.read_through < s
        )
        self.read_through = step
        cfg = self.config
        for s, batch, record in new:
            cause, in_a_row = int(record[_CAUSE]), int(record[_RUN])
            if not cause:
                continue
            self._event(
                "skip",
                step=s,
                batch=batch,
                cause=CAUSES[cause],
                in_a_row=in_a_row,
                **dict(zip(SIGNALS, record[_VALUES], strict=True)),
                window_mean=dict(zip(SIGNALS, record[_MEAN], strict=True)),
                window_std=dict(zip(SIGNALS, record[_STD], strict=True)),
            )
            if cause == 3 or (cfg.max_consecutive and in_a_row >= cfg.max_consecutive):
                # Later records are of steps the rewind undoes.
                self._rewind(step, s, batch, s - in_a_row + 1, CAUSES[cause], control)
                return

    def _rewind(
        self, step: int, bad: int, batch: int, first_bad: int, cause: str, control: RunControl
    ) -> None:
        cfg = self.config
        done = len(self._own_ranges(control))
        reason = f"{cause} at step {bad}, {bad - first_bad + 1} bad step(s) from step {first_bad}"
        if done >= cfg.max_rewinds:
            raise PluginError(
                f"{self.name}: {reason}, after {done} rewinds already "
                f"({self.name}.max_rewinds): the data is not the cause; lower optimizer.lr or "
                f"look at {EVENT_LOG} in job.dump_folder"
            )
        to_step = first_bad - cfg.rewind_min_steps
        through = batch + cfg.skip_margin
        self._event(
            "rewind_requested", step=step, bad_step=bad, to_step=to_step, through_batch=through
        )
        control.rewind(step, to_step, through, self.name, reason)

    def _log_rewinds(self, control: RunControl) -> None:
        """Log the rewinds done since the last call (the host knows them: no device read)."""
        for rewind in control.rewinds[self._logged_rewinds :]:
            if rewind.source == self.name:
                skipped = rewind.skipped
                self._event(
                    "rewind",
                    step=rewind.step,
                    loaded_step=rewind.loaded_step,
                    batches=[skipped.first, skipped.last] if skipped else None,
                    reason=rewind.reason,
                )
        self._logged_rewinds = len(control.rewinds)

    def _event(self, event: str, **fields: Any) -> None:
        if self.log_path is not None:
            with self.log_path.open("a") as f:
                f.write(json.dumps({"event": event, **fields}) + "\n")
