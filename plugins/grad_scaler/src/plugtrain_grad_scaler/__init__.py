"""Dynamic loss scaling for float16 training, as a plugtrain plugin; a no-op otherwise.

float16 has 5 exponent bits: small gradients underflow to zero unless the loss is multiplied
by a large factor before backward and the gradients divided by it afterwards. bfloat16 and
float32 have float32's exponent range, so scaling them would only add inf/nan checks, a
collective and a host sync per step for nothing. With ``enabled = "auto"`` (the default) the
plugin is therefore active exactly when the resolved parameter dtype is float16, and otherwise
deactivates itself in ``setup``: no hooks fire and no state is saved.

Per optimizer step, when active, the hooks run :class:`torch.amp.GradScaler`'s canonical loop
(scale, backward, ``unscale_``, clip, ``step``, ``update``) spread over the trainer's hooks:

* ``pre_backward``: ``ctx.loss = scaler.scale(ctx.loss)`` for each microbatch;
* ``post_backward`` (the core's "run first" slot): ``scaler.unscale_``, once, so that every
  other ``post_backward`` implementation (clipping, gradient statistics) sees true gradients;
* ``pre_step``: ``scaler.step``'s decision: veto the step if any rank found inf/nan;
* ``post_step``: ``scaler.update()``, backing the scale off after a skipped step and growing
  it after ``growth_interval`` clean ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.optim import Optimizer

from plugtrain.plugin import ConfigError, SetupContext, StepContext, check_field, hookimpl

__all__ = ["GradScaler", "GradScalerConfig"]


@dataclass
class GradScalerConfig:
    """The ``[grad_scaler]`` config section."""

    enabled: bool | Literal["auto"] = "auto"
    """"auto": scale exactly when training.mixed_precision_param is float16; true: the same,
    but any other dtype is an error; false: never scale."""
    init_scale: float = 2.0**16
    """The loss scale of the first step (and of a resume from a checkpoint without one)."""
    growth_factor: float = 2.0
    """The scale is multiplied by this after ``growth_interval`` consecutive clean steps."""
    backoff_factor: float = 0.5
    """The scale is multiplied by this after each step with inf/nan gradients (skipped)."""
    growth_interval: int = 2000
    """Consecutive steps without inf/nan gradients before the scale grows."""

    def __post_init__(self) -> None:
        check_field(
            0 < self.init_scale < float("inf"),
            "init_scale",
            f"must be finite and > 0, got {self.init_scale}",
        )
        check_field(
            1 < self.growth_factor < float("inf"),
            "growth_factor",
            f"must be finite and > 1, got {self.growth_factor}",
        )
        check_field(
            0 < self.backoff_factor < 1,
            "backoff_factor",
            f"must be in (0, 1), got {self.backoff_factor}",
        )
        check_field(
            self.growth_interval >= 1,
            "growth_interval",
            f"must be >= 1, got {self.growth_interval}",
        )


class _StepGate:
    """Stands in for the optimizer in ``torch.amp.GradScaler.unscale_`` and ``.step``.

    It exposes the optimizer's ``param_groups`` (all ``unscale_`` reads), and its ``step()``
    records that torch's ``GradScaler.step`` decided to step instead of stepping: the trainer
    calls ``optimizer.step()`` itself, and the LR scheduler with it, unless a plugin vetoes.

    This lets the plugin use torch's GradScaler's public methods only, in the canonical order.
    ``scaler.step(gate)`` runs exactly the non-fused path of ``scaler.step(optimizer)`` (the
    found_inf check, summed over devices, read with one ``.item()``) and leaves the recorded
    inf checks that ``update()`` asserts on. The alternative, reading the private
    ``scaler._found_inf_per_device(optimizer)``, would duplicate that decision by hand. The
    gate deliberately lacks ``_step_supports_amp_scaling``: with a fused optimizer (the
    trainer's on CUDA) the gradients are already unscaled and the step is skipped as a whole,
    which is what the fused kernel's own found_inf check would have done (bit for bit: see
    tests/test_equivalence.py, fused AdamW on CPU).
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self.opened = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self) -> None:
        self.opened = True


class GradScaler:
    """Scales the loss of float16 runs and skips the steps whose gradients overflow.

    The entry point names this class; the plugin manager makes one instance per run.
    """

    def __init__(self) -> None:
        self.config = GradScalerConfig()
        self.scaler: torch.amp.GradScaler | None = None
        """None until ``setup`` finds the run in float16 (and in every inactive run)."""
        self._gate: _StepGate | None = None
        self.skipped_steps = 0
        """Steps skipped because their gradients held inf/nan, over the whole run."""
        self.name = "grad_scaler"
        """The name the run enables the plugin under (its entry point's), set in ``setup``."""

    @hookimpl
    def config_section(self) -> type:
        return GradScalerConfig

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.name = name = ctx.name_of(self)
        self.config = cfg = ctx.plugin_config(self)
        dtype = str(ctx.param_dtype).removeprefix("torch.")
        if ctx.param_dtype != torch.float16:
            if cfg.enabled is True:
                raise ConfigError(
                    f"config key '{name}.enabled' is true but training.mixed_precision_param "
                    f"is {dtype}: loss scaling is for float16 only ({dtype} has float32's "
                    f'exponent range and needs none); set {name}.enabled = "auto" or false'
                )
            ctx.deactivate(self, f"{name}: {dtype} needs no loss scaling, inactive")
            return
        if cfg.enabled is False:
            ctx.deactivate(self, f"{name}: enabled = false, float16 runs without loss scaling")
            return
        # NOTE: torch.amp.GradScaler, not FSDP's ShardedGradScaler. With FSDP2 the gradients
        # are DTensors, and DTensor's dispatcher all-reduces (max) the found_inf flag of
        # _amp_foreach_non_finite_check_and_unscale_ inside unscale_: one collective per step,
        # and every rank skips together. ShardedGradScaler (built for FSDP1's plain tensors)
        # all-reduces found_inf again on top: two collectives instead of one (found_inf = 2.0
        # on 2 ranks), plus its CPU update reads the flag with extra .item() calls. Measured
        # on 2 processes by tests/test_two_processes.py::test_choice_of_grad_scaler_class.
        # The device type is passed explicitly: GradScaler() defaults to "cuda" and silently
        # disables itself on a machine without CUDA.
        self.scaler = torch.amp.GradScaler(
            ctx.device.type,
            init_scale=cfg.init_scale,
            growth_factor=cfg.growth_factor,
            backoff_factor=cfg.backoff_factor,
            growth_interval=cfg.growth_interval,
        )
        self._gate = _StepGate(ctx.optimizer)
        ctx.register_loss_scaler(self)

    @hookimpl
    def pre_backward(self, ctx: StepContext) -> None:
        ctx.loss = self._active().scale(ctx.loss)

    @hookimpl(tryfirst=True)
    def post_backward(self) -> None:
        self._active().unscale_(self._gate)  # type: ignore[arg-type]

    @hookimpl
    def pre_step(self) -> str | None:
        scaler, gate = self._active(), self._gate
        assert gate is not None
        gate.opened = False
        # The one host sync per step that float16 training needs: GradScaler.step reads
        # found_inf (already all-reduced over ranks in unscale_) with .item() to decide.
        scaler.step(gate)  # type: ignore[arg-type]
        if gate.opened:
            return None
        self.skipped_steps += 1
        # The trainer logs this reason: the plugin's one line per skipped step. Reading the
        # scale for it costs a second .item(), on skipped steps only.
        scale = scaler.get_scale()
        return (
            f"{self.name}: inf/nan gradients at loss scale {scale:g}, "
            f"the scale backs off to {scale * self.config.backoff_factor:g}"
        )

    @hookimpl
    def post_step(self) -> None:
        self._active().update()

    @hookimpl
    def step_metrics(self) -> dict[str, float | int]:
        # get_scale() reads the scale with .item(): on logging steps only.
        return {"loss_scale": self._active().get_scale(), "skipped_steps": self.skipped_steps}

    @hookimpl
    def state_dict(self) -> dict[str, Any]:
        state = self._active().state_dict()
        # Only the state that evolves; the factors and interval come from the config, so
        # a resumed run may change them. Plain tensors: saved without pickling.
        return {
            "scale": torch.tensor(state["scale"], dtype=torch.float32),
            "growth_tracker": torch.tensor(state["_growth_tracker"], dtype=torch.int64),
            "skipped_steps": torch.tensor(self.skipped_steps, dtype=torch.int64),
        }

    @hookimpl
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # saved while inactive (a bfloat16 run): keep init_scale
            return
        scaler = self._active()
        state = scaler.state_dict()
        state["scale"] = float(state_dict["scale"])
        state["_growth_tracker"] = int(state_dict["growth_tracker"])
        scaler.load_state_dict(state)
        self.skipped_steps = int(state_dict["skipped_steps"])

    def _active(self) -> torch.amp.GradScaler:
        # Hooks fire only after setup kept the plugin registered, i.e. created the scaler.
        assert self.scaler is not None, f"{self.name}: hook fired while inactive"
        return self.scaler
