"""The optimizer and its schedule: AdamW, linear warmup, then cosine or linear decay."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from plugtrain.config import LRSchedulerConfig, OptimizerConfig


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, device: torch.device
) -> torch.optim.AdamW:
    """AdamW over every parameter of ``model``, fused on CUDA."""
    return torch.optim.AdamW(
        model.parameters(),
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=device.type == "cuda",
    )


def lr_factor(step: int, cfg: LRSchedulerConfig, total_steps: int) -> float:
    """The multiplier of the peak LR for the optimizer step that follows ``step`` taken steps.

    Warmup rises linearly to 1 at the end of ``cfg.warmup_steps``; then the factor decays to
    ``cfg.min_lr_ratio`` at ``total_steps``.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.decay_type == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif cfg.decay_type == "linear":
        decay = 1.0 - progress
    else:
        decay = 1.0
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


class PlannedLR(LambdaLR):
    """A ``LambdaLR`` over :func:`lr_factor` whose length, ``total_steps``, is part of its state.

    ``LambdaLR.state_dict`` saves every attribute but the optimizer and the lambdas, and its
    ``load_state_dict`` restores them; the lambda reads ``total_steps`` at each call, so a
    resumed run keeps the length its schedule was planned for, whatever its ``training.steps``.
    """

    def __init__(self, optimizer: Optimizer, cfg: LRSchedulerConfig, total_steps: int) -> None:
        self.total_steps = total_steps
        """The optimizer steps the decay spans; after them the factor stays at its final value."""

        def factor(step: int) -> float:
            return lr_factor(step, cfg, self.total_steps)

        # Set before: LambdaLR's constructor already calls the lambda.
        super().__init__(optimizer, factor)


def build_lr_scheduler(optimizer: Optimizer, cfg: LRSchedulerConfig, total_steps: int) -> PlannedLR:
    """The schedule of :func:`lr_factor` over ``total_steps``; its ``last_epoch`` counts the
    steps taken.

    A vetoed step does not call ``scheduler.step()``, so the schedule follows the
    optimizer steps that really happened, not the loop counter.
    """
    return PlannedLR(optimizer, cfg, total_steps)
