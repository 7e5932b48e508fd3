"""The optimizer and its schedule: fused AdamW, warmup then decay (or WSD), all on the device.

The core's fused AdamW is the default; a plugin may build another from the model's named
parameters (the ``build_optimizer`` hook), which the schedule drives the same way: every param
group's ``lr`` is a tensor the schedule scales in place.

The schedule never reads the device: the learning rate is a tensor in the optimizer's param
group, and it is computed on the device from the number of optimizer steps actually applied,
itself counted on the device (a vetoed step adds 0). So a step whose veto is known only on the
device still leaves the schedule where it was, without a host sync.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from plugtrain.config import LRSchedulerConfig, OptimizerConfig
from plugtrain.errors import ConfigError, PluginError
from plugtrain.training.conversion import trainable_named_parameters


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, device: torch.device
) -> torch.optim.AdamW:
    """Fused AdamW over every trainable parameter of ``model`` (not the frozen), on every
    device.

    Fused, because its kernel takes the step's skip flag (``found_inf``) on the device, and it
    is the fastest AdamW on CPU too. The learning rate is a float32 tensor on ``device``, which
    :class:`LRSchedule` updates in place. With ``cfg.no_decay`` the parameters it names form a
    second group, without weight decay; a name part that matches no parameter is a
    :class:`ConfigError`.
    """
    named = trainable_named_parameters(model)
    params: list[Any] = [p for _, p in named]
    if cfg.no_decay:
        # Against every name, frozen ones too: the key is right whatever a plugin freezes.
        every = [name for name, _ in model.named_parameters()]
        for part in cfg.no_decay:
            if not any(part in name for name in every):
                raise ConfigError(
                    f"config key 'optimizer.no_decay' names '{part}', which is in no "
                    f"parameter's name (they look like '{every[-1]}'): fix or remove it"
                )
        exempt = [any(part in name for part in cfg.no_decay) for name, _ in named]
        params = [
            {"params": [p for (_, p), e in zip(named, exempt, strict=True) if not e]},
            {
                "params": [p for (_, p), e in zip(named, exempt, strict=True) if e],
                "weight_decay": 0.0,
                "lr": torch.tensor(cfg.lr, dtype=torch.float32, device=device),
            },
        ]
    return torch.optim.AdamW(
        params,
        lr=torch.tensor(cfg.lr, dtype=torch.float32, device=device),
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=True,
    )


def plugin_optimizer(
    answers: dict[str, Any], params: tuple[nn.Parameter, ...], device: torch.device
) -> tuple[str, Optimizer] | None:
    """The plugin and optimizer of ``build_optimizer``'s ``answers`` (by plugin name), checked
    against the hook's contract; None if no plugin answered. Two answers, an optimizer that
    does not hold each of ``params`` (the trainable parameters) once, or a group whose ``lr``
    is not a 0-d float tensor on ``device`` are each a :class:`PluginError`."""
    if len(answers) > 1:
        names = " and ".join(f"'{name}'" for name in answers)
        raise PluginError(f"plugins {names} both build the optimizer: enable only one of them")
    if not answers:
        return None
    ((name, optimizer),) = answers.items()
    if not isinstance(optimizer, Optimizer):
        raise PluginError(
            f"plugin '{name}': build_optimizer returned a {type(optimizer).__name__}, not a "
            "torch.optim.Optimizer"
        )
    held = [id(p) for group in optimizer.param_groups for p in group["params"]]
    if sorted(held) != sorted(id(p) for p in params):
        raise PluginError(
            f"plugin '{name}': its optimizer holds {len(held)} parameter tensors where the model "
            f"trains {len(params)}: it must hold each of ctx.named_parameters (the trainable "
            "ones) exactly once"
        )
    for i, group in enumerate(optimizer.param_groups):
        lr = group.get("lr")
        if not (
            isinstance(lr, torch.Tensor)
            and lr.ndim == 0
            and lr.is_floating_point()
            and lr.device == device
        ):
            raise PluginError(
                f"plugin '{name}': its optimizer's param group {i} has lr {lr!r:.60}; give "
                "every group ctx.learning_rate(peak), which the LR schedule scales in place"
            )
    return name, optimizer


def describe_param_groups(optimizer: Optimizer) -> str:
    """One line on ``optimizer``'s param groups: each group's tensors and elements, and the
    settings in which the groups differ (``weight_decay 0``), for the start-up log."""
    groups = optimizer.param_groups
    keys = [k for k in dict.fromkeys(k for g in groups for k in g) if k not in ("params", "lr")]
    # A setting is shown where the groups that have it differ in it (a plugin's optimizer
    # may give its groups different keys: Muon's and AdamW's).
    shown = [k for k in keys if len({repr(g[k]) for g in groups if k in g}) > 1]
    parts = []
    for i, group in enumerate(groups):
        numel = sum(p.numel() for p in group["params"])
        settings = "".join(f", {k} {group[k]}" for k in shown if k in group)
        parts.append(f"[{i}] {len(group['params'])} tensors, {numel:,} params{settings}")
    return f"{type(optimizer).__name__}, {len(groups)} param group(s): " + "; ".join(parts)


_SHAPES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "cosine": lambda p: 0.5 * (1.0 + torch.cos(math.pi * p)),
    "linear": lambda p: 1.0 - p,
    "1-sqrt": lambda p: 1.0 - torch.sqrt(p),
    "constant": torch.ones_like,
}
"""Each decay's shape: from 1 to 0 over the decay's progress from 0 to 1 (``constant``: 1)."""


def lr_factor(step: torch.Tensor, cfg: LRSchedulerConfig, total_steps: int) -> torch.Tensor:
    """The multiplier of the peak LR for the optimizer step that follows ``step`` applied steps.

    Warmup rises linearly to 1 at the end of ``cfg.warmup_steps``; then the factor decays to
    ``cfg.min_lr_ratio`` at ``total_steps`` and stays there: from the end of the warmup on, or,
    for ``wsd``, over the last ``cfg.decay_steps`` steps only (shaped by ``cfg.decay_shape``),
    after a stable phase at the peak. Computed in float64 on ``step``'s device, with tensor
    operations only.
    """
    s = step.to(torch.float64)
    warmup = cfg.warmup_steps
    if cfg.decay_type == "wsd":
        assert cfg.decay_steps is not None  # the config requires it
        start, length, shape = total_steps - cfg.decay_steps, cfg.decay_steps, cfg.decay_shape
    else:
        start, length, shape = warmup, max(1, total_steps - warmup), cfg.decay_type
    progress = ((s - start) / length).clamp(0.0, 1.0)
    factor = cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * _SHAPES[shape](progress)
    if warmup:
        factor = torch.where(s < warmup, (s + 1.0) / warmup, factor)
    return factor


class LRSchedule:
    """Sets each param group's learning rate (a tensor) from the applied-step count.

    ``step(applied)`` adds ``applied`` (a 0-d bool or int tensor: 0 for a vetoed step) to the
    count and updates the learning rates in place, on the device. Its state, for checkpoints,
    is the count and the number of steps the schedule was planned for.
    """

    def __init__(self, optimizer: Optimizer, cfg: LRSchedulerConfig, total_steps: int) -> None:
        self.optimizer, self.cfg, self.total_steps = optimizer, cfg, total_steps
        self.peaks = [group["lr"].clone() for group in optimizer.param_groups]
        self.applied_steps = torch.zeros((), dtype=torch.int64, device=self.peaks[0].device)
        """Optimizer steps applied so far (vetoed ones not counted), on the device."""
        self._update()

    def step(self, applied: torch.Tensor) -> None:
        """Count one more step if ``applied`` (on the device), and set the next step's LR."""
        self.applied_steps += applied
        self._update()

    def _update(self) -> None:
        factor = lr_factor(self.applied_steps, self.cfg, self.total_steps)
        # The groups are looked up each time: loading an optimizer state replaces them.
        for group, peak in zip(self.optimizer.param_groups, self.peaks, strict=True):
            group["lr"].copy_(peak * factor)

    def last_lr(self) -> torch.Tensor:
        """The learning rate of the next step (first param group), a 0-d tensor."""
        return self.optimizer.param_groups[0]["lr"]

    def resize_note(self, steps: int, step: int, lr: float) -> str | None:
        """What a resumed run at ``step`` whose ``training.steps`` changed to ``steps`` does
        (None if it did not change): the schedule keeps the length it was planned for, so that
        the learning rate (peak ``lr``) never jumps."""
        planned = self.total_steps
        if planned == steps:
            return None
        if steps > planned:
            first = max(planned, step) + 1
            if first > steps:
                return None  # nothing left to train
            final = lr * lr_factor(torch.tensor(planned), self.cfg, planned).item()
            what = f"steps {first}-{steps} train at the schedule's final learning rate, {final:.3g}"
            if self.cfg.decay_type != "constant":
                what += " (min_lr_ratio x lr)"
        else:
            what = f"the run stops at step {steps}, before the learning rate has fully decayed"
        return (
            f"training.steps is {steps} but the resumed run's LR schedule was planned for "
            f"{planned} steps: {what}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"applied_steps": self.applied_steps, "total_steps": self.total_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.applied_steps.copy_(state_dict["applied_steps"])
        self.total_steps = int(state_dict["total_steps"])
        self._update()
