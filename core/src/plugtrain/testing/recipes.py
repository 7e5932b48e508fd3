"""Hand-written training loops that plugins are checked against: the canonical fp16 recipe.

:func:`canonical_fp16_loop` trains a plugin-free :class:`Trainer`'s model, fused optimizer, LR
schedule and data the way the PyTorch AMP docs write it, on the trainer's device (CPU or CUDA),
so that a run through the ``grad_scaler`` (and ``grad_clip``) plugins can be compared with it
bit for bit.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from plugtrain.model import cross_entropy
from plugtrain.plugin import full_tensor
from plugtrain.testing.faults import poison
from plugtrain.testing.runs import Trainer


def grad_norm(model: torch.nn.Module) -> float:
    """The global 2-norm of the model's gradients, read on the host."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.stack([full_tensor(g).norm() for g in grads]).norm().item()


@dataclass
class RecipeResult:
    """What :func:`canonical_fp16_loop` saw, step by step."""

    scales: list[float] = field(default_factory=list)
    """The loss scale after each step's ``update``."""
    norms: list[float] = field(default_factory=list)
    """The global gradient norm after each step's ``unscale_`` (before clipping)."""


def canonical_fp16_loop(
    trainer: Trainer,
    steps: int,
    inf_steps: Collection[int] = (),
    max_norm: float | None = None,
    growth_interval: int = 2000,
) -> RecipeResult:
    """Train ``trainer`` (built without plugins) ``steps`` steps with ``torch.amp.GradScaler``:
    scale, backward, [inf into the first gradient on ``inf_steps``], ``unscale_``,
    [``clip_grad_norm_`` to ``max_norm``, foreach], ``step``, ``update``.

    The LR schedule advances only on steps the scaler did not skip (a skip is seen as the scale
    backing off), as plugtrain's does. Reads the device every step: a reference, not a fast loop.
    """
    model, optimizer, lr_scheduler = trainer.model, trainer.optimizer, trainer.lr_scheduler
    device = trainer.device
    scaler = torch.amp.GradScaler(device.type, growth_interval=growth_interval)
    result = RecipeResult()
    for step in range(1, steps + 1):
        batch = trainer.batches.next_batch()
        for microbatch in batch:
            loss = cross_entropy(model(microbatch.inputs), microbatch.targets)
            scaler.scale(loss / len(batch)).backward()
        if step in inf_steps:
            poison(model)
        scaler.unscale_(optimizer)
        result.norms.append(grad_norm(model))
        if max_norm is not None:
            # NOTE: foreach=True, as grad_clip: by default DTensor gradients (FSDP2) take the
            # per-tensor norm, whose CUDA reduction rounds differently from the foreach kernel's
            # (on the CPU both are the per-tensor norm).
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        applied = scaler.get_scale() >= scale_before
        lr_scheduler.step(torch.tensor(applied, device=device))
        optimizer.zero_grad(set_to_none=True)
        result.scales.append(scaler.get_scale())
    return result
