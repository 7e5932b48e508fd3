"""Model conversion as a run does it: firing ``convert_model``, and again for an offline export.

The trainer fires the hook on the meta-device model before wrapping and parallelising it
(:func:`fire_convert_model`); the record it leaves (``plugtrain.model.conversion``) steers the
initialisation, tensor parallelism, initial load and export. ``plugtrain export-hf`` runs
without the training run, so it learns the export rules of a checkpoint whose model a plugin
converted the same way (:func:`saved_conversion`): it rebuilds the model on the meta device
from the run's saved config, loads the plugins that config enabled and fires
``convert_model`` again. No tensor is allocated for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy
import torch
from torch import nn

from plugtrain.checkpoint import SavedCheckpoint
from plugtrain.config import JobConfig, build_config, enabled_plugins
from plugtrain.distributed import ParallelDims
from plugtrain.errors import ConfigError
from plugtrain.host import PluginHost, installed_plugins
from plugtrain.model import Conversion, conversion_of, model_spec
from plugtrain.plugin import ConvertContext

__all__ = [
    "converted_model",
    "fire_convert_model",
    "saved_conversion",
    "trainable_named_parameters",
]


def fire_convert_model(
    hook: pluggy.HookRelay,
    config: JobConfig,
    model: nn.Module,
    name_of: Callable[[object], str],
    parallel_dims: ParallelDims,
    training: bool = True,
) -> Conversion:
    """Fire ``convert_model`` on ``model`` (on the meta device, unsharded) of a job laid out
    as ``parallel_dims``; return its record, closed to further additions and freezes.
    ``training`` refuses a run whose checkpoints would need a stored parameter (False for
    the export and the estimate, which train nothing)."""
    conversion = conversion_of(model)
    ctx = ConvertContext(
        config=config,
        model=model,
        blocks=tuple(model.layers.values()),  # type: ignore[arg-type]
        parallel_dims=parallel_dims,
        conversion=conversion,
        name_of=name_of,
    )
    conversion.open = True
    try:
        hook.convert_model(ctx=ctx)
    finally:
        conversion.open = False
    checkpoint = config.checkpoint
    saves = checkpoint.enable or checkpoint.save_final
    if training and conversion.stored and saves and not checkpoint.initial_load_path:
        name, storage = next(iter(conversion.stored.items()))
        raise ConfigError(
            f"plugin '{conversion.frozen[name]}' holds '{name}' as {storage.name}, which a "
            "checkpoint never holds, and no checkpoint.initial_load_path gives it back on "
            "resume: set checkpoint.initial_load_path (a Hugging Face folder), or "
            "checkpoint.enable = false and checkpoint.save_final = false"
        )
    return conversion


def trainable_named_parameters(model: nn.Module) -> tuple[tuple[str, nn.Parameter], ...]:
    """``model``'s parameters that train (``requires_grad``) with their names, in
    ``model.named_parameters()`` order: what an optimizer holds and the step hooks see."""
    return tuple((name, p) for name, p in model.named_parameters() if p.requires_grad)


def saved_conversion(
    saved: SavedCheckpoint, weights: str, host: PluginHost | None = None
) -> Conversion | None:
    """The conversion of the run that saved ``saved``, for its export; None when its
    ``weights`` hold no tensor beyond the model's own (nothing to learn, no plugin loaded).

    The run's saved config names its plugins and their sections: they are loaded as the run
    loaded them (or ``host``'s are used, already registered), the model is built on the meta
    device and ``convert_model`` fires."""
    stored = saved.tensors(weights)
    if set(stored) <= set(saved.spec.hf.parameter_shapes(saved.args)):
        return None
    values: dict[str, dict[str, Any]] = {
        k: v for k, v in saved.config.items() if isinstance(v, dict)
    }
    if host is None:
        host = PluginHost()
        host.load_enabled(enabled_plugins(values))
    config = build_config(values, host.results("config_section"), installed_plugins())
    return conversion_of(converted_model(config, host, saved.args))


def converted_model(config: JobConfig, host: PluginHost, args: Any) -> nn.Module:
    """The model of shape ``args`` (its family's, ``model.family``) on the meta device (no
    storage), converted by ``host``'s plugins as a run of ``config`` converts it: for what
    needs its parameters' shapes and rules without training (the export's rules, the memory
    estimate's counts)."""
    with torch.device("meta"):
        model = model_spec(config.model.family).build(args)
    # One process: the export and the estimate need the parameters, not a job's layout.
    fire_convert_model(host.hook, config, model, host.name_of, ParallelDims(), training=False)
    return model
