"""Real contexts for calling one hook in a unit test: step, setup, model and convert contexts.

One process, the CPU; the config is validated as a run validates it, so a bad value raises
:class:`~plugtrain.plugin.ConfigError`.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from plugtrain.checkpoint import export_checkpoint
from plugtrain.plugin import (
    ConvertContext,
    ModelContext,
    ParallelDims,
    SetupContext,
    StepContext,
)
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


def _toml(value: object) -> str:
    """``value`` as TOML writes it: a bool, a number (inf and nan too), a string or a list."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else f"{'-' if value < 0 else ''}inf"
    if isinstance(value, int | float | str):
        return json.dumps(value)  # a JSON number or string is a TOML one
    if isinstance(value, list):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    raise TypeError(f"cannot write {value!r} as a TOML config value")


def _configured(
    plugins: dict[str, object] | None,
    args: Sequence[str],
    values: Mapping[str, Mapping[str, object]] | None = None,
) -> tuple[JobConfig, Callable[[object], str]]:
    """A tiny run's validated config with ``values`` (in a TOML file) and ``args`` on top, and
    ``name_of`` answering from ``plugins``."""
    from plugtrain.training import configure

    folder = Path(tempfile.mkdtemp(prefix="plugtrain-setup-"))
    if values:
        toml = folder / "config.toml"
        toml.write_text(
            "".join(
                f"[{section}]\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in keys.items())
                for section, keys in values.items()
            )
        )
        args = ["--config", str(toml), *args]
    configured = configure(tiny_args(folder, *args))
    assert configured is not None
    names = {id(obj): name for name, obj in (plugins or {}).items()}

    def name_of(plugin: object) -> str:
        return names[id(plugin)]

    return configured[0], name_of


def setup_context(
    plugins: dict[str, object] | None = None,
    *args: str,
    values: Mapping[str, Mapping[str, object]] | None = None,
    model: nn.Module | None = None,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    parallel_dims: ParallelDims | None = None,
) -> SetupContext:
    """A real :class:`~plugtrain.plugin.SetupContext` for calling ``setup`` in a unit test.

    ``plugins`` maps the names the plugin objects run under to the objects (``name_of``
    answers from it); ``args`` are config overrides, validated as a run validates them
    (``"--plugins.enabled", "grad_clip", "--grad_clip.max_norm", "2"``), so
    ``ctx.plugin_config(plugin)`` returns the plugin's section and a bad value raises
    :class:`~plugtrain.plugin.ConfigError`. ``values`` are config sections as a TOML file gives
    them, typed (``{"grad_clip": {"max_norm": 0}}``), under ``args``. One process, the CPU;
    ``parallel_dims`` (default: a world of one) has no mesh (``get_mesh`` refuses): give
    ``ParallelDims(tp=2)`` to see what a plugin does under tensor parallelism."""
    config, name_of = _configured(plugins, args, values)
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
        parallel_dims=parallel_dims or ParallelDims(),
        name_of=name_of,
        export_hf=export_checkpoint,
    )


def model_context(
    plugins: dict[str, object] | None = None,
    *args: str,
    model: nn.Module | None = None,
    param_dtype: torch.dtype = torch.float32,
    parallel_dims: ParallelDims | None = None,
) -> ModelContext:
    """A real :class:`~plugtrain.plugin.ModelContext` for calling ``wrap_model`` or
    ``compile_model`` in a unit test.

    ``plugins`` and ``args`` as for :func:`setup_context`. The model is the tiny flavor's
    ``Transformer``, on the CPU and initialised (seed 0), unless ``model`` is given: the hooks
    can be checked by running it. One process, the CPU; ``parallel_dims`` as for
    :func:`setup_context`.
    """
    from plugtrain.model import FLAVORS, Transformer, cross_entropy

    config, name_of = _configured(plugins, args)
    if model is None:
        model = Transformer(FLAVORS["tiny"])
        model.init_weights(seed=0)
    return ModelContext(
        config=config,
        model=model,
        blocks=tuple(model.layers.values()),  # type: ignore[arg-type]
        norm=model.norm,  # type: ignore[arg-type]
        loss_fn=cross_entropy,
        device=torch.device("cpu"),
        param_dtype=param_dtype,
        reduce_dtype=torch.float32,
        parallel_dims=parallel_dims or ParallelDims(),
        name_of=name_of,
    )


def convert_context(
    plugins: dict[str, object] | None = None,
    *args: str,
    parallel_dims: ParallelDims | None = None,
    flavor: str = "tiny",
) -> ConvertContext:
    """A real :class:`~plugtrain.plugin.ConvertContext` for calling ``convert_model`` in a
    unit test: the ``Transformer`` of ``flavor`` (``tiny`` by default) on the meta device, as
    a run converts it, its conversion record open (``ctx.conversion``). ``plugins`` and
    ``args`` as for :func:`setup_context`; ``parallel_dims`` the job's layout (one process by
    default)."""
    from plugtrain.model import FLAVORS, Conversion, Transformer

    config, name_of = _configured(plugins, args)
    with torch.device("meta"):
        model = Transformer(FLAVORS[flavor])
    return ConvertContext(
        config=config,
        model=model,
        blocks=tuple(model.layers.values()),  # type: ignore[arg-type]
        parallel_dims=parallel_dims or ParallelDims(),
        conversion=Conversion(open=True),
        name_of=name_of,
    )
