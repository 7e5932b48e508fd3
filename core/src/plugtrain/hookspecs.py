"""The hook contract: every hook the trainer fires, when it fires, and what it may change.

This module is plugtrain's plugin API; the trainer is written against it and plugins implement
it with :data:`plugtrain.plugin.hookimpl`. A training step fires, in this order::

    for each microbatch:  forward -> pre_backward -> loss.backward()
    post_backward                       # once, gradients complete
    pre_step                            # once, any plugin may veto
    optimizer.step(); lr_scheduler.step()   # unless vetoed
    post_step                           # once, with whether the step was skipped
    step_metrics                        # on logging steps only

Ordering rules (pluggy's, made part of the contract):

* Registration order is **not** part of the contract: entry points load in an unstable order,
  and every result here must be the same whichever order plugins were registered in.
* ``post_backward`` has a "run first" slot: an implementation marked
  ``@hookimpl(tryfirst=True)`` runs before every plain one. It is reserved for plugins that put
  the gradients into their true value (the loss scaler unscales there), so that every plain
  ``post_backward`` implementation (clipping, gradient statistics) sees true gradients. Use it
  for nothing else; two "run first" plugins must not depend on each other's order.
* A hook that raises stops the step; the exception reaches the trainer and ends the run.

Every hook is called with keyword arguments; an implementation may accept any subset of the
arguments its spec names (pluggy checks this at registration) and must not ask for others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

from plugtrain.plugin import PROJECT_NAME

if TYPE_CHECKING:
    from plugtrain.plugin import Metrics, SetupContext, StepContext

hookspec = pluggy.HookspecMarker(PROJECT_NAME)


@hookspec
def config_section() -> type | None:
    """Return this plugin's config dataclass, or None if it takes no config.

    Fires once, when the plugin is loaded, before the config is validated. The section's name in
    the TOML file and on the command line is the plugin's name (its entry point name):
    ``[grad_clip]`` / ``--grad_clip.max_norm 1.0``. Every field needs a default; the config
    system checks types and unknown keys, and the dataclass's ``__post_init__`` checks ranges
    (raise :class:`plugtrain.plugin.ConfigError`, e.g. via ``check_field``).
    """


@hookspec
def setup(ctx: SetupContext) -> None:
    """Fires once per run, after the model is sharded and the optimizer, LR scheduler and
    mixed-precision policy exist, before any checkpoint is loaded and before the first step.

    Read the resolved dtypes (``ctx.param_dtype``) and your config (``ctx.plugin_config(self)``)
    here and allocate what you need. A plugin with nothing to do in this run calls
    ``ctx.deactivate(self, reason)``: it is then unregistered and costs nothing.
    """


@hookspec
def pre_backward(ctx: StepContext) -> None:
    """Fires before each microbatch's ``backward()``, ``ctx.num_microbatches`` times per step.

    ``ctx.loss`` is the scalar tensor backward will run on (the microbatch loss divided by the
    number of microbatches); ``ctx.microbatch`` is its index. A plugin may replace ``ctx.loss``
    with another tensor of the same graph (a loss scaler multiplies it). The trainer logs the
    loss as it was before this hook, whatever plugins do.
    """


@hookspec
def post_backward(ctx: StepContext) -> None:
    """Fires once per optimizer step, after the last microbatch's backward, when the gradients
    are complete: FSDP2's reduce-scatter has finished and each rank holds its gradient shards
    (DTensors, averaged over ranks, in the parameters' dtype).

    Plugins may read and modify the gradients in place. The ``tryfirst=True`` slot is reserved
    for making gradients true (unscaling); plain implementations see true gradients.
    """


@hookspec
def pre_step(ctx: StepContext) -> str | None:
    """Fires once per step, right before ``optimizer.step()``. Return a reason to veto the step.

    If any implementation returns a non-empty string, the trainer skips ``optimizer.step()``
    and ``lr_scheduler.step()`` (the step counter still advances) and tells every plugin in
    ``post_step``. The core does not synchronise vetoes across ranks: base a veto on values
    that are already global (an all-reduced norm, a synchronised inf flag), so that every rank
    takes the same decision.
    """


@hookspec
def post_step(ctx: StepContext) -> None:
    """Fires once per step, after ``optimizer.step()`` or its skip, before gradients are zeroed.

    ``ctx.skipped`` says whether the step was vetoed and ``ctx.skip_reasons`` why. A loss scaler
    updates its scale here.
    """


@hookspec
def step_metrics(ctx: StepContext) -> Metrics | None:
    """Fires after ``post_step`` on logging steps only (every ``metrics.log_freq`` steps).

    Return scalar metrics for this step, ``{"grad_norm": norm}``; values may be 0-d tensors
    (the trainer reads them once per logging step, so keep per-step work free of ``.item()``).
    They are logged as ``<plugin name>/<key>``; metrics should be identical on every rank.
    """


@hookspec
def state_dict() -> dict[str, Any] | None:
    """Return the plugin's state for a checkpoint, or None if it has none.

    Called on every rank when a checkpoint is saved. Values must be tensors or Python numbers
    (they are written with torch.distributed.checkpoint, never pickled), in nested dicts and
    lists. The state is saved under the plugin's name. A plain tensor or number is saved once
    for all ranks, so it must be the same on every rank; state that differs by rank goes in a
    DTensor. Also called once when a run resumes, after ``setup``: the checkpoint's values are
    loaded into the structure it returns, then handed to ``load_state_dict``.
    """


@hookspec
def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Restore the state that ``state_dict`` returned, when a run resumes from a checkpoint.

    Fires after ``setup``, only if the checkpoint holds state for this plugin; a plugin whose
    state is absent (the checkpoint was made without it, or while it was deactivated) keeps the
    state ``setup`` gave it.
    """
