"""plugtrain plugin: clip the gradients by their global norm, once per optimizer step.

The total norm is the true norm of the whole model's gradient, over every parameter, rank and
FSDP2 shard, as ``torch.nn.utils.clip_grad_norm_`` would compute it on the unsharded model;
under pipeline parallelism over every stage too, each rank clipping its stages' gradients by
the whole model's norm.
Clipping is a gradient transform, so it runs in the contract's modify phase (``post_backward``):
a loss scaler has unscaled the gradients before it, and observers have seen them unclipped.
Nothing is read from the device: the norm stays a tensor, and a non-finite norm vetoes the
step with a device flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from plugtrain.plugin import (
    ParallelDims,
    SetupContext,
    StepContext,
    check_field,
    grouped_by_mesh,
    hookimpl,
    total_norm,
)

__all__ = ["GradClip", "GradClipConfig"]


@dataclass
class GradClipConfig:
    max_norm: float = 1.0
    """Clip the gradients so that their total norm is at most this (finite, > 0)."""
    norm_type: float = 2.0
    """Order of the total norm: 2.0 (Euclidean), any p > 0, or inf (largest absolute value)."""
    on_nonfinite: Literal["skip", "raise"] = "skip"
    """When the total norm is inf or nan and no loss scaler is enabled: ``skip`` vetoes the
    optimizer step (and the LR schedule), counted in ``skipped_steps.grad_clip``; ``raise``
    vetoes it too, then stops the run at the next logging step (the first moment the host
    reads the device), naming the step. With a loss scaler enabled, non-finite gradients are
    the scaler's to handle (it skips the step)."""

    def __post_init__(self) -> None:
        check_field(
            0 < self.max_norm < math.inf,
            "max_norm",
            f"must be finite and > 0, got {self.max_norm}",
        )
        check_field(
            self.norm_type > 0,
            "norm_type",
            f"must be > 0 (2.0 for the Euclidean norm, inf for the max norm), got {self.norm_type}",
        )


class GradClip:
    """Clips the gradients in place in ``post_backward`` and reports the pre-clip norm."""

    def __init__(self) -> None:
        self.config = GradClipConfig()
        self.name = "grad_clip"
        """The name the run enables the plugin under (its entry point's), set in ``setup``."""
        self.total_norm = torch.zeros(())
        """The last step's pre-clip total norm: a 0-d fp32 tensor, the same on every rank."""
        self.first_nonfinite_step = torch.zeros((), dtype=torch.int64)
        """The first step whose norm was not finite (0: none yet), for ``on_nonfinite = raise``."""
        self.dims = ParallelDims()
        """The job's parallel dimensions, set in ``setup``: the norm is the pipeline's."""

    @hookimpl
    def config_section(self) -> type:
        return GradClipConfig

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.name = ctx.name_of(self)
        self.config = ctx.plugin_config(self)
        self.dims = ctx.parallel_dims
        ctx.show_on_console(self, "grad_norm")
        self.first_nonfinite_step = self.first_nonfinite_step.to(ctx.device)

    @hookimpl
    def post_backward(self, ctx: StepContext) -> None:
        params = [p for p in ctx.params if p.grad is not None]
        grads = [p.grad for p in params]
        # NOTE: FSDP2 keeps the sharded parameters, hence their gradients, in fp32 whatever
        # training.mixed_precision_param says (it casts only the unsharded copies used in
        # forward and backward), so the norm is computed in fp32.
        norm = total_norm(grads, self.config.norm_type, dims=self.dims)
        # One foreach kernel per mesh: under expert parallelism the experts have their own.
        for group in grouped_by_mesh(params):
            torch.nn.utils.clip_grads_with_norm_(group, self.config.max_norm, norm, foreach=True)
        self.total_norm = norm

    @hookimpl
    def pre_step(self, ctx: StepContext) -> torch.Tensor | None:
        if ctx.loss_scaler is not None:
            return None  # non-finite gradients are the loss scaler's to skip
        nonfinite = self.total_norm.isfinite().logical_not()
        if self.config.on_nonfinite == "raise":
            first = self.first_nonfinite_step
            first.copy_(torch.where(nonfinite & (first == 0), ctx.step, first))
        return nonfinite

    @hookimpl
    def step_metrics(self, ctx: StepContext) -> dict[str, torch.Tensor]:
        if self.config.on_nonfinite == "raise" and (step := int(self.first_nonfinite_step)):
            raise FloatingPointError(
                f"{self.name}: the total gradient norm at step {step} is not finite: the loss "
                f"or the gradients overflowed (lower optimizer.lr, or set "
                f"{self.name}.on_nonfinite = 'skip' to skip such steps)"
            )
        clipped = (self.total_norm > self.config.max_norm).float()
        return {"grad_norm": self.total_norm, "clipped": clipped}
