"""Dynamic loss scaling for float16 training, as a plugtrain plugin; a no-op otherwise.

float16 has 5 exponent bits: small gradients underflow to zero unless the loss is multiplied
by a large factor before backward and the gradients divided by it afterwards. bfloat16 and
float32 have float32's exponent range, so scaling them would only add inf/nan checks, a
collective and work per step for nothing. With ``enabled = "auto"`` (the default) the plugin
is therefore active exactly when the resolved parameter dtype is float16, and otherwise
deactivates itself in ``setup``: no hooks fire and no state is saved.

When active it runs :class:`torch.amp.GradScaler`'s canonical loop (scale, backward,
``unscale_``, clip, ``step``, ``update``) with the same two device kernels, spread over the
hook contract's gradient phases, and never reads the device:

* ``pre_backward``: the loss is multiplied by the scale, for each microbatch;
* ``unscale_gradients``: the gradients are divided by it and checked for inf/nan
  (``torch._amp_foreach_non_finite_check_and_unscale_``);
* ``pre_step``: the inf flag is the veto, a device tensor the fused optimizer reads as its
  ``found_inf``, as ``GradScaler.step`` gives it to a fused optimizer;
* ``post_step``: ``torch._amp_update_scale_`` backs the scale off after an overflow and grows
  it after ``growth_interval`` clean steps.

Under pipeline parallelism the loss exists on the last stage only, so ``pre_backward`` scales it
there; the gradients the schedule sends back to the earlier stages carry the scale, so every
stage's gradients are scaled and every rank unscales by the same scale. The inf flag is agreed
over the stages (one more all-reduce, under a pipeline only): an overflow on one stage skips
the step on every rank, and the scale, updated from the same flag, stays the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from plugtrain.plugin import (
    ConfigError,
    ParallelDims,
    SetupContext,
    StepContext,
    check_field,
    grouped_by_mesh,
    hookimpl,
    reduce_over_replicas,
    reduce_over_stages,
)

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


class GradScaler:
    """Scales the loss of float16 runs and skips the steps whose gradients overflow.

    The entry point names this class; the plugin manager makes one instance per run. Its
    state (scale, growth tracker, skipped steps) lives on the training device.
    """

    def __init__(self) -> None:
        self.config = GradScalerConfig()
        self.name = "grad_scaler"
        """The name the run enables the plugin under (its entry point's), set in ``setup``."""
        self.scale: torch.Tensor | None = None
        """The loss scale, a float32 0-d tensor; None in an inactive run."""
        self.growth_tracker = torch.zeros((), dtype=torch.int32)
        self.found_inf = torch.zeros(())
        """1.0 if this step's gradients held inf/nan (the same on every rank), else 0.0."""
        self.skipped_steps = torch.zeros((), dtype=torch.int64)
        """Steps skipped because their gradients held inf/nan, over the whole run."""
        self.dims = ParallelDims()
        """The job's parallel dimensions, set in ``setup``: the flag is agreed over ``pp``."""

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
        device, self.dims = ctx.device, ctx.parallel_dims
        self.scale = torch.full((), cfg.init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = self.growth_tracker.to(device)
        self.found_inf = self.found_inf.to(device)
        self.skipped_steps = self.skipped_steps.to(device)
        ctx.register_loss_scaler(self)
        ctx.show_on_console(self, "loss_scale")  # its skips show in the core's skipped_steps

    @hookimpl
    def pre_backward(self, ctx: StepContext) -> None:
        ctx.loss = ctx.loss * self._active()

    @hookimpl
    def unscale_gradients(self, ctx: StepContext) -> None:
        # NOTE: torch.amp.GradScaler's kernel, not FSDP's ShardedGradScaler. With FSDP2 the
        # gradients are DTensors, and DTensor's dispatcher all-reduces (max) the found_inf
        # flag of this kernel: one collective per step, and every rank skips together.
        # ShardedGradScaler (built for FSDP1's plain tensors) all-reduces found_inf again on
        # top: two collectives instead of one (found_inf = 2.0 on 2 ranks). Measured on 2
        # processes by tests/test_two_processes.py::test_choice_of_grad_scaler_class.
        # Under HSDP that all-reduce covers the shards of one replica only (DTensor takes the
        # replicas' gradients to be equal): reduce_over_replicas makes the flag the same on
        # every replica even if one's gradients went bad after FSDP2's all-reduce.
        # Under expert parallelism the experts' gradients are on a mesh of their own: one
        # kernel (and one all-reduce, over every rank) per mesh, into the same flag.
        # Under pipeline parallelism those meshes are this stage's: reduce_over_stages agrees
        # the flag over the stages, a stage without gradients (all frozen) joining with 0.
        inv_scale = self._active().double().reciprocal().float()
        self.found_inf.zero_()
        grads = ctx.gradients()
        for group in grouped_by_mesh(grads):
            torch._amp_foreach_non_finite_check_and_unscale_(group, self.found_inf, inv_scale)
        if grads:
            reduce_over_replicas(self.found_inf, grads[0])
        reduce_over_stages(self.found_inf, self.dims)

    @hookimpl
    def pre_step(self) -> torch.Tensor:
        return self.found_inf > 0

    @hookimpl
    def post_step(self) -> None:
        self.skipped_steps += (self.found_inf > 0).long()
        torch._amp_update_scale_(
            self._active(),
            self.growth_tracker,
            self.found_inf,
            self.config.growth_factor,
            self.config.backoff_factor,
            self.config.growth_interval,
        )

    @hookimpl
    def step_metrics(self) -> dict[str, torch.Tensor]:
        return {"loss_scale": self._active(), "skipped_steps": self.skipped_steps}

    @hookimpl
    def state_dict(self) -> dict[str, Any]:
        # Only the state that evolves; the factors and interval come from the config, so a
        # resumed run may change them.
        return {
            "scale": self._active(),
            "growth_tracker": self.growth_tracker,
            "skipped_steps": self.skipped_steps,
        }

    @hookimpl
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # saved while inactive (a bfloat16 run): keep init_scale
            return
        self._active().copy_(state_dict["scale"])
        self.growth_tracker.copy_(state_dict["growth_tracker"])
        self.skipped_steps.copy_(state_dict["skipped_steps"])

    def _active(self) -> torch.Tensor:
        # Hooks fire only after setup kept the plugin registered, i.e. created the scale.
        assert self.scale is not None, f"{self.name}: hook fired while inactive"
        return self.scale
