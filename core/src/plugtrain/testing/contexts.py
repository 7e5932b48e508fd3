"""Real contexts for calling one hook in a unit test: step, setup and model contexts.

One process, the CPU; the config is validated as a run validates it, so a bad value raises
:class:`~plugtrain.plugin.ConfigError`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from plugtrain.plugin import ModelContext, SetupContext, StepContext
from plugtrain.testing.runs import tiny_args

if TYPE_CHECKING:
    from plugtrain.config import JobConfig


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model(torch.ones(3, 4)).square().sum().backward()
    return model


def step_context(
    model: nn.Module | None = None,
    step: int = 1,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    num_microbatches: int = 1,
    microbatch: int = 0,
    loss: torch.Tensor | None = None,
    skipped: bool | None = None,
    skip_reasons: Sequence[str] = (),
    loss_scaler: str | None = None,
) -> StepContext:
    """A real :class:`~plugtrain.plugin.StepContext` for calling one hook in a unit test.

    Without ``model``, a small MLP whose gradients are already computed (deterministic: seed
    0). ``optimizer`` defaults to SGD over its parameters; ``skipped`` becomes the 0-d bool
    tensor ``post_step`` sees. The parameters are plain tensors, not FSDP2 DTensors: hooks
    that rely on DTensor placements need a real run (:func:`~plugtrain.testing.tiny_run`).
    """
    model = _tiny_model() if model is None else model
    params = tuple(model.parameters())
    return StepContext(
        step=step,
        num_microbatches=num_microbatches,
        model=model,
        optimizer=optimizer if optimizer is not None else torch.optim.SGD(params, lr=0.1),
        params=params,
        loss_scaler=loss_scaler,
        microbatch=microbatch,
        loss=loss,
        skipped=None if skipped is None else torch.tensor(skipped),
        skip_reasons=list(skip_reasons),
    )


def _configured(
    plugins: dict[str, object] | None, args: Sequence[str]
) -> tuple[JobConfig, Callable[[object], str]]:
    """A tiny run's validated config with ``args``, and ``name_of`` answering from ``plugins``."""
    from plugtrain.training.launch import configure

    configured = configure(tiny_args(tempfile.mkdtemp(prefix="plugtrain-setup-"), *args))
    assert configured is not None
    names = {id(obj): name for name, obj in (plugins or {}).items()}

    def name_of(plugin: object) -> str:
        return names[id(plugin)]

    return configured[0], name_of


def setup_context(
    plugins: dict[str, object] | None = None,
    *args: str,
    model: nn.Module | None = None,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
) -> SetupContext:
    """A real :class:`~plugtrain.plugin.SetupContext` for calling ``setup`` in a unit test.

    ``plugins`` maps the names the plugin objects run under to the objects (``name_of``
    answers from it); ``args`` are config overrides, validated as a run validates them
    (``"--plugins.enabled", "grad_clip", "--grad_clip.max_norm", "2"``), so
    ``ctx.plugin_config(plugin)`` returns the plugin's section. One process, the CPU, no mesh.
    """
    config, name_of = _configured(plugins, args)
    model = _tiny_model() if model is None else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return SetupContext(
        config=config,
        model=model,
        optimizer=optimizer,
        lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        device=torch.device("cpu"),
        mesh=None,  # type: ignore[arg-type]
        rank=0,
        world_size=1,
        name_of=name_of,
    )


def model_context(
    plugins: dict[str, object] | None = None,
    *args: str,
    model: nn.Module | None = None,
    param_dtype: torch.dtype = torch.float32,
) -> ModelContext:
    """A real :class:`~plugtrain.plugin.ModelContext` for calling ``wrap_model`` or
    ``compile_model`` in a unit test.

    ``plugins`` and ``args`` as for :func:`setup_context`. The model is the tiny flavor's
    ``Transformer``, on the CPU and initialised (seed 0), unless ``model`` is given: the hooks
    can be checked by running it. One process, the CPU.
    """
    from plugtrain.model.transformer import FLAVORS, Transformer

    config, name_of = _configured(plugins, args)
    if model is None:
        model = Transformer(FLAVORS["tiny"])
        model.init_weights(seed=0)
    return ModelContext(
        config=config,
        model=model,
        blocks=tuple(model.layers),  # type: ignore[arg-type]
        device=torch.device("cpu"),
        param_dtype=param_dtype,
        reduce_dtype=torch.float32,
        rank=0,
        world_size=1,
        name_of=name_of,
    )
