"""An exponential moving average of the weights, sharded like the model, as a plugtrain plugin.

Each rank keeps an fp32 average of its own shards of the trainable parameters (a parameter
frozen in ``convert_model`` never changes, so its average is itself): DTensors with the parameters'
placements, updated in ``post_step`` from the local shards, with no collective and no host read.
A skipped step (any plugin's device veto) leaves the average unchanged: the update's weight is
``where(skipped, 0, 1 - decay_t)``, computed on the device.

The decay warms up as in TensorFlow's ``ExponentialMovingAverage(num_updates=...)`` and timm:
the ``t``-th update (from 0) decays by ``decay_t = min(decay, (1 + t) / (10 + t))``, so the
average forgets the initial weights within tens of updates instead of ~``1 / (1 - decay)``
(a 0.999 average of 40 steps would still be 96% the initial weights). Adam's bias correction
does not apply: it rescales an average started from zero, and this one starts as a copy of the
weights. ``t`` counts the update steps after ``start_step``, vetoed ones included: a function of
the step number, known on the host, so the update reads nothing from the device and a resumed
run continues it exactly. The average is saved in every
checkpoint through the ``state_dict`` hook (DCP reshards it to another world size), validated
on (swapped into the model's shards for an extra pass, logged as ``<name>/validation_loss``) and
exported as a model-only checkpoint, ``step-<N>/<name>/``, beside each training checkpoint.
Under pipeline parallelism each rank averages its stages' parameters, under the whole model's
names: the saved and exported averages hold every stage's, as one process's would.
"""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from plugtrain.plugin import (
    ConfigError,
    SetupContext,
    StepContext,
    ValidationContext,
    check_field,
    hookimpl,
    local_tensor,
)

__all__ = ["Ema", "EmaConfig", "load_exported"]

logger = logging.getLogger("plugtrain")

DEFAULT_DECAY = 0.999


@dataclass
class EmaConfig:
    """The ``[ema]`` config section."""

    decay: float | None = None
    """The average's share of its past at each update, in [0, 1); 0.999 unless ``half_life``
    is set."""
    half_life: float | None = None
    """Instead of ``decay``: training steps after which a weight's share of the average has
    halved; each update then decays by ``0.5 ** (every_n_steps / half_life)``."""
    warmup: bool = True
    """Warm the decay up: the ``t``-th update (from 0) uses ``min(decay, (1 + t) / (10 + t))``,
    so that an early average is not mostly the initial weights; false: ``decay`` throughout."""
    start_step: int = 0
    """Up to this step the average is a copy of the weights; averaging starts after it."""
    every_n_steps: int = 1
    """After ``start_step``, update the average on the steps divisible by this."""
    validate: bool = True
    """When validation is due, also validate the averaged weights (``<name>/validation_loss``,
    beside the model's own ``validation_loss``)."""
    export: bool = True
    """Export the averaged weights as a model-only checkpoint, ``step-<N>/<name>/``, in each
    training checkpoint's folder."""

    def __post_init__(self) -> None:
        check_field(
            self.decay is None or self.half_life is None,
            "decay",
            f"is {self.decay} and half_life is {self.half_life}: set one of them",
        )
        if self.decay is not None:
            check_field(0 <= self.decay < 1, "decay", f"must be in [0, 1), got {self.decay}")
        if self.half_life is not None:
            check_field(
                0 < self.half_life < math.inf,
                "half_life",
                f"must be a finite number of steps > 0, got {self.half_life}",
            )
        check_field(self.start_step >= 0, "start_step", f"must be >= 0, got {self.start_step}")
        check_field(
            self.every_n_steps >= 1, "every_n_steps", f"must be >= 1, got {self.every_n_steps}"
        )

    def update_decay(self) -> float:
        """The average's share of its past at each update."""
        if self.half_life is not None:
            return 0.5 ** (self.every_n_steps / self.half_life)
        return DEFAULT_DECAY if self.decay is None else self.decay

    def updates(self, steps: int) -> int:
        """The update steps after ``start_step`` up to step ``steps``."""
        return max(0, steps // self.every_n_steps - self.start_step // self.every_n_steps)

    def update_weight(self, step: int) -> float | None:
        """The share of the weights in the average after ``step``: 1 (a copy) up to
        ``start_step``, then ``1 - decay_t`` on update steps; None when ``step`` updates nothing."""
        if step <= self.start_step:
            return 1.0
        if step % self.every_n_steps:
            return None
        decay = self.update_decay()
        if self.warmup:
            t = self.updates(step) - 1
            decay = min(decay, (1 + t) / (10 + t))
        return 1.0 - decay

    def idle_warning(self, steps: int) -> str | None:
        """Why the average cannot do its job in a run of ``steps`` steps, or None."""
        updates = self.updates(steps)
        if not updates:
            return (
                f"no update step within training.steps = {steps} (start_step {self.start_step}, "
                f"every_n_steps {self.every_n_steps}): the average stays a copy of the weights"
            )
        decay = self.update_decay()
        if not self.warmup and updates * (1 - decay) < 1:
            return (
                f"decay {decay:.6g} averages over ~{1 / (1 - decay):,.0f} updates but the run "
                f"has {updates}: the average stays close to the initial weights; set warmup = "
                "true or a lower decay"
            )
        return None


class Ema:
    """Keeps an fp32 exponential moving average of this rank's parameter shards."""

    def __init__(self) -> None:
        self.config = EmaConfig()
        self.name = "ema"
        """The name the run enables the plugin under (its entry point's), set in ``setup``."""
        self.rank = 0
        self.params: tuple[torch.nn.Parameter, ...] = ()
        self.average: dict[str, torch.Tensor] = {}
        """The average of each parameter, by its name in the model: fp32, shaped like the
        parameter (a DTensor with its placements when the model is sharded)."""
        self.step = 0
        """The last step the average saw (``post_step``)."""
        self._averages: list[torch.Tensor] = []
        """The local shards of :attr:`average`, in parameter order."""
        self._swapped_out: list[torch.Tensor] = []
        """The model's own shards while the average is swapped in for validation."""
        self._loaded = False

    @hookimpl
    def config_section(self) -> type:
        return EmaConfig

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.name = ctx.name_of(self)
        self.config = ctx.plugin_config(self)
        self.rank = ctx.parallel_dims.rank
        if self.config.export and "://" in ctx.config.job.dump_folder:
            # Its export writes a folder beside the checkpoint's files, which a URL has not.
            raise ConfigError(
                f"config key '{self.name}.export' is true, but job.dump_folder "
                f"{ctx.config.job.dump_folder} is a URL: set {self.name}.export false"
            )
        idle = self.config.idle_warning(ctx.config.training.steps)
        if idle and ctx.parallel_dims.is_main:
            logger.warning("%s: %s", self.name, idle)
        if self.config.validate:
            ctx.show_on_console(self, "validation_loss")
        # The trainable parameters: a frozen one (convert_model) is its own average.
        named = [(name, p) for name, p in ctx.model.named_parameters() if p.requires_grad]
        self.params = tuple(p for _, p in named)
        with torch.no_grad():
            self.average = {
                name: torch.empty_like(p, dtype=torch.float32).copy_(p) for name, p in named
            }
        self._averages = [local_tensor(a) for a in self.average.values()]

    def _shards(self) -> list[torch.Tensor]:
        return [local_tensor(p.detach()) for p in self.params]

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        self.step = ctx.step
        weight = self.config.update_weight(ctx.step)
        if weight is None:
            return
        assert ctx.skipped is not None
        # On the device: a skipped step gives weight 0, which leaves the average as it is.
        weight_t = torch.where(ctx.skipped, 0.0, weight)
        with torch.no_grad():
            # One weight per tensor: the single-tensor-weight overload reads it with .item().
            weights = [weight_t] * len(self._averages)
            torch._foreach_lerp_(self._averages, self._shards(), weights)

    @hookimpl
    def validation_weights(self) -> list[str] | None:
        return [self.name] if self.config.validate else None

    @hookimpl
    def pre_validation(self, ctx: ValidationContext) -> None:
        if ctx.weights != self.name:
            return
        with torch.no_grad():
            shards = self._shards()
            self._swapped_out = [s.clone() for s in shards]
            torch._foreach_copy_(shards, self._averages)

    @hookimpl
    def post_validation(self, ctx: ValidationContext) -> None:
        if ctx.weights != self.name:
            return
        with torch.no_grad():
            torch._foreach_copy_(self._shards(), self._swapped_out)
        self._swapped_out = []

    @hookimpl
    def state_dict(self) -> dict[str, Any]:
        return {"average": self.average, "step": self.step}

    @hookimpl
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with torch.no_grad():
            for name, average in self.average.items():
                loaded = state_dict["average"][name]
                if loaded is not average:
                    average.copy_(loaded)
        self.step = int(state_dict["step"])
        self._loaded = True

    @hookimpl
    def checkpoint_loaded(self, folder: Path, step: int) -> None:
        if self._loaded:
            return
        # A checkpoint made without this plugin: average from the weights it resumes.
        with torch.no_grad():
            torch._foreach_copy_(self._averages, self._shards())
        self.step = step
        if self.rank == 0:
            logger.warning(
                "%s: checkpoint %s holds no average of the weights; averaging starts afresh "
                "from its weights at step %d",
                self.name,
                folder,
                step,
            )

    @hookimpl
    def checkpoint_saved(self, folder: Path, step: int) -> None:
        if not self.config.export:
            return
        # After an async save the average may have moved on: read the one saved at `step`.
        average = self.average if step == self.step else self._saved_average(folder)
        target = folder / self.name
        partial = target.with_name(target.name + ".partial")
        if self.rank == 0 and partial.exists():  # left by a crash while exporting
            shutil.rmtree(partial)
        if dist.is_initialized():  # no rank writes there before the leftover is gone
            dist.barrier()
        dcp.save({"model": average}, checkpoint_id=partial)
        if self.rank == 0:  # DCP's coordinator: its save returns once the folder is complete
            partial.rename(target)

    def _saved_average(self, folder: Path) -> dict[str, torch.Tensor]:
        average = {name: torch.empty_like(a) for name, a in self.average.items()}
        dcp.load({"plugins": {self.name: {"average": average}}}, checkpoint_id=folder)
        return average


def load_exported(model: torch.nn.Module, folder: str | Path) -> None:
    """Load exported averaged weights (``step-<N>/<name>/``) into ``model``'s parameters.

    ``model`` is the same architecture, plain or sharded with FSDP2 on any number of ranks
    (DCP reshards); call it on every rank of a distributed model. Its trainable parameters
    are loaded: the average holds no frozen one, which the model already has.
    """
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    state = {"model": {k: v for k, v in get_model_state_dict(model).items() if k in trainable}}
    dcp.load(state, checkpoint_id=Path(folder))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
