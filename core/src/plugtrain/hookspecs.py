"""The hook contract: every hook the trainer fires, when it fires, and what it may change.

This module is plugtrain's plugin API; the trainer is written against it and plugins implement
it with :data:`plugtrain.plugin.hookimpl`. Building the run fires, once, in this order::

    model built on the meta device (no storage, unsharded)
    convert_model            # model phase 0, convert: add parameters, freeze others
    wrap_model               # model phase 1, wrap: activation checkpointing, per block or whole
    compile_model            # model phase 2, compile: torch.compile (at most one compiler)
    parallelise: tensor parallelism (parallelism.tp), then FSDP2's fully_shard
    materialise (to_empty), init_weights(seed)   # or the initial load, for the base weights
    build_optimizer          # at most one plugin builds the optimizer (else: fused AdamW)
    setup                    # the optimizer, schedule and dtypes exist
    build_loss               # at most one plugin answers the loss (else: the cross-entropy)

What each build phase may change (``docs/writing-plugins.md``, "What a plugin may and may
not change", says it for users):

* ``convert_model`` alone changes the parameter set: it adds parameters, each with its init,
  tensor-parallel style and export rule, and freezes others (``requires_grad`` False). It never
  renames, replaces or removes a base parameter, so a checkpoint's base keys, the
  tensor-parallel plan and the Hugging Face names stay the model's; the base weights are drawn
  as in a run without the plugin. It may wrap the forwards that use what it added.
* ``wrap_model`` and ``compile_model`` change forwards only, never a parameter or a module.
* The parallelisation is the core's: no hook adds, removes or reshapes a parallel dimension,
  and every hook before it sees plain, whole tensors on the meta device. From
  ``build_optimizer`` on, parameters are DTensors: under ``parallelism.tp`` each is split by
  the model's plan (an added one by its own style), then sharded over ``dp_shard`` by FSDP2;
  ``p.shape`` is the full shape either way.
* ``build_optimizer`` and every later hook see the trainable parameters only
  (``ctx.named_parameters``, ``ctx.params``); frozen ones stay in the model and in checkpoints,
  bit for bit. No hook changes the step's structure (microbatches, backward, the optimizer
  step): a plugin acts through the hooks below.

A training step fires, in this order::

    for each microbatch:  forward -> loss_terms -> pre_backward -> loss.backward()
                          # with a build_loss answer: its units, then its loss, instead
    unscale_gradients        # gradient phase 1, make true: a loss scaler unscales
    observe_gradients        # gradient phase 2, observe: read-only (statistics, norms, spikes)
    post_backward            # gradient phase 3, modify: clipping and other gradient transforms
    pre_step                 # gradient phase 4, decide: any plugin may veto, on the device
    optimizer.step(); LR schedule advances   # unless vetoed (applied on the device)
    post_step                # with the step's skip flag, a 0-d bool tensor
    step_metrics             # on logging steps only

Outside the step: ``validation_weights``, then ``pre_validation`` -> evaluate ->
``validation_metrics`` -> ``post_validation`` once per weight set, when validation is due;
``checkpoint_saved`` once a checkpoint is complete and ``checkpoint_loaded`` once a run has
resumed from one.

Ordering rules:

* Registration order is **not** part of the contract: entry points load in an unstable order,
  and every result must be the same whichever order plugins were registered in. The gradient
  phases are what makes that hold: each phase is a hook of its own, so every observer sees the
  true, unclipped gradients and every decision sees the modified ones, whatever the order of
  the plugins. The model phases do the same for the model: every wrapper is applied before any
  compiler sees the model, so a compiler compiles the wrapped blocks. Within a phase the order
  is unspecified: implementations of one phase must not depend on each other (two loss scalers
  or two compilers are refused; two gradient transforms, or two wrappers, must commute).
  ``tryfirst``/``trylast`` are not part of the contract.
* A hook that raises stops the step; the exception reaches the trainer and ends the run.

No host syncs: the step hooks run while the device may still be computing. Reading a device
value on the host (``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()``, a print) makes the host
wait for the device and stalls the step. Keep step hooks to device work; veto with a 0-d bool
tensor (``pre_step``), report with tensors (``step_metrics``, read on logging steps only).
``metrics.trace_hooks`` counts each plugin's syncs and collectives per hook.

Run control: a plugin that decides, on the host, that the run must skip data, go back to a
checkpoint or stop asks through ``ctx.control`` (:class:`plugtrain.plugin.RunControl`, also on
the ``SetupContext``): ``skip_batches(first, last, ...)`` skips a range of global batch numbers
(``ctx.batch`` is this step's); ``rewind(step, to_step, through_batch, ...)`` reloads the
latest checkpoint at ``to_step`` or earlier and skips the batches from there through
``through_batch``; ``stop(...)`` ends the run cleanly, as a SIGTERM does. Requests take effect
after the step that makes them, after its checkpoint; skipped ranges are kept in
``<job.dump_folder>/data_skips.json`` and in every checkpoint, and survive restarts and
rewinds. Every rank must make the same requests at the same step, so decide them from global
values read on the host where a read is already paid for (``step_metrics``, on logging steps),
never with a per-step read: the latency is then up to ``metrics.log_freq`` steps. A plugin that
must end the run with an error raises a one-line :class:`plugtrain.plugin.PluginError`.

Every hook is called with keyword arguments; an implementation may accept any subset of the
arguments its spec names (pluggy checks this at registration) and must not ask for others.

Result hooks (:data:`RESULT_HOOKS`): each plugin's answer belongs to that plugin (its config
section, its loss terms, its veto, its metrics, its weight sets, its state), so the trainer
receives the non-None answers by plugin name, in the order of the names, whatever the order
the plugins were registered in; the implementations run in that order too. They fire through
pluggy like every other hook (the hook trace and cost counts see them), but a ``wrapper=True``
or ``hookwrapper=True`` implementation of one is refused at registration: a wrapper could only
see, or replace, the answers of the other plugins. ``load_state_dict`` fires for one plugin at a
time, with that plugin's own state.

The job's layout: ``ModelContext``, ``OptimizerContext`` and ``SetupContext`` carry
``ctx.parallel_dims`` (:class:`plugtrain.plugin.ParallelDims`), built once per run from
``[parallelism]``: each dimension's degree (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``,
``tp``, ``ep``) and ``*_enabled``, this rank's index in each (``rank_in("tp")``),
the world's ``rank``, ``world_size`` and ``is_main``, the ranks that train on different data
(``dp_rank`` of ``dp_size``) and the meshes by name (``get_mesh("dp")``, ``get_mesh("tp")``).
A plugin reads the layout there, never from ``config.parallelism``.

What a hook sees under tensor parallelism (``ctx.parallel_dims.tp_enabled``): the model hooks
see the whole model on the meta device, before it is split: the plan addresses modules by
name, which is why a wrapper may not rename them. From ``build_optimizer`` on, every parameter
and gradient is a DTensor over the ``("dp_shard", "tp")`` mesh (``("dp_replicate", "dp_shard",
"tp")`` under HSDP): sharded over ``tp`` for the projections and the vocabulary-sharded
embedding and output, replicated over it for the norms; ``p.shape`` is the full shape. The
logits a ``loss_terms`` hook receives are a DTensor sharded over the vocabulary (read
``ctx.lse``, never gather them); ``ctx.lse`` is a plain tensor, the replicated value each rank
holds, and ``ctx.mask`` and ``ctx.count`` are the same on every rank of a ``tp`` group. The
ranks of one ``tp`` group read the same batches and compute the same loss: reduce a value of
the data over the ``dp_size`` ranks of :func:`plugtrain.plugin.data_parallel_group`, not over
the world.

What a hook sees under pipeline parallelism (``ctx.parallel_dims.pp_enabled``): the model hooks
see the whole model on the meta device, before it is cut into stages; from ``build_optimizer``
on, each rank holds only its stages' parameters (the model's ``ctx.model``, ``ctx.params``,
``ctx.named_parameters`` and ``ctx.gradients()`` are that share, possibly without any trainable
one, under the whole model's names), sharded over the data-parallel mesh (``pp`` is in no
parameter's mesh). The step's microbatches run through the stages by the schedule
(``parallelism.pp_schedule``), not one after another, so:

* ``loss_terms`` and ``pre_backward`` fire on the ranks of the last stage only, once per
  microbatch, in order (``ctx.microbatch`` 0 .. n-1), before the schedule runs that
  microbatch's backward from ``ctx.loss``; a loss scaler's factor reaches the other stages
  through the gradients they receive. A value a plugin takes from them (the loss) is the last
  stage's: :func:`plugtrain.plugin.reduce_over_stages` gives it to every rank.
* The gradient phases, ``post_step`` and ``step_metrics`` fire once per step on every rank,
  after every stage's backward. A value of the gradients is reduced over the stages as well as
  the shards: :func:`plugtrain.plugin.total_norm` given ``dims`` (the layout ``setup`` saw)
  gives the whole model's norm on every rank, and a found-inf flag agreed with
  ``reduce_over_stages`` makes every rank skip together. The loss the trainer logs is the last
  stage's, summed over ``pp``.
* ``build_loss`` answers (a loss that runs the model itself) are refused, as are plugins that
  run the whole model's forward (``samples``, ``downstream_eval``: refused at ``setup`` with
  :func:`plugtrain.plugin.refuse_split_model`). Validation runs the stages' forward in
  order, between ``pre_validation`` and ``post_validation`` on every rank.
* The zero-bubble schedules take each block's weight gradients apart from its input gradients;
  no block is resharded after its forward under a pipeline, as they need.

What a hook sees under context parallelism (``ctx.parallel_dims.cp_enabled``): each rank of a
``cp`` group holds its part of every row of the batch they share (two chunks, one from each
end), so ``loss_terms`` receives this rank's tokens' logits, targets and mask, and
``ctx.count`` the step's count over every rank's part: a term normalised as ``loss_terms``
asks sums, over the ranks, to the whole rows' term. The parameters and gradients are
sharded over ``dp_shard x cp`` (``get_mesh("dp")``, :func:`plugtrain.plugin.data_parallel_group`,
whose ``size()`` counts the ``cp`` ranks: reduce a value of the tokens over it); a plugin that
runs the whole model's forward is refused (``refuse_split_model``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

from plugtrain import PROJECT_NAME

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from pathlib import Path

    import torch

    from plugtrain.plugin import (
        ConvertContext,
        LossContext,
        Metrics,
        ModelContext,
        OptimizerContext,
        SetupContext,
        StepContext,
        StepLoss,
        ValidationContext,
    )

hookspec = pluggy.HookspecMarker(PROJECT_NAME)

RESULT_HOOKS = (
    "config_section",
    "build_optimizer",
    "build_loss",
    "loss_terms",
    "pre_step",
    "step_metrics",
    "validation_weights",
    "validation_metrics",
    "state_dict",
)
"""The hooks whose answers the trainer receives by plugin name (see the module docstring)."""


@hookspec
def config_section() -> type | None:
    """Return this plugin's config dataclass, or None if it takes no config.

    Fires once, when the plugin is loaded, before the config is validated. The section's name in
    the TOML file and on the command line is the plugin's name (its entry point name):
    ``[grad_clip]`` / ``--grad_clip.max_norm 1.0``. Every field needs a default; the config
    system checks types and unknown keys, and the dataclass's ``__post_init__`` checks ranges
    (raise :class:`plugtrain.plugin.ConfigError`, e.g. via ``check_field``). The settings a
    resumed run must keep (they shape the plugin's parameters or the run's trajectory) are
    named in a ``FIXED_ON_RESUME: ClassVar[tuple[str, ...]]`` of the dataclass: a resume that
    changes one is refused in one line, naming it and both values; every other may change.
    """


@hookspec
def convert_model(ctx: ConvertContext) -> None:
    """Model phase 0, convert: add parameters to the model, freeze others (LoRA adapters).

    Fires once per run, before ``wrap_model``, on the model as built: on the meta device
    (parameters without storage), unsharded and not tensor-parallel. Add parameters with
    ``ctx.add_parameter(self, module, name, shape, init=..., tp=..., export=...)``, each with
    how it is initialised (a seeded fill, reproducible), placed under tensor parallelism and
    exported to Hugging Face (merged into a base weight, or dropped); freeze base parameters
    with ``ctx.freeze(self, *names)`` (``saved=False``: a run with an initial load leaves them
    out of its checkpoints and re-reads them from it, checked by hash); set the writer of
    ``export-hf --adapter`` with ``ctx.set_adapter(self, writer)``; let what was added be
    switched off with ``ctx.set_switch(self, switch)`` (``switch(False)``: the model computes
    as if nothing was added, changing no parameter; ``switch(True)`` undoes it), which
    :func:`plugtrain.plugin.additions_off` flips for another plugin (dpo's ``adapters_off``
    reference: the base model, no second copy). All are refused outside this hook. Never
    rename, replace or remove a parameter or module; wrap the forwards that use what was added with
    :func:`plugtrain.plugin.wrap_forward`. Implementations must commute: two plugins may add
    parameters side by side, but not to each other's.
    """


@hookspec
def wrap_model(ctx: ModelContext) -> None:
    """Model phase 1, wrap: put structural wrappers around the blocks or the whole model.

    Fires once per run, after ``convert_model`` and before ``compile_model``: the model
    is on the meta device (parameters without storage), not yet sharded with FSDP2, and not yet
    initialised. ``ctx.device``, ``ctx.param_dtype`` and ``ctx.parallel_dims`` say what the run
    will do with it. Wrap forwards in place with :func:`plugtrain.plugin.wrap_forward`
    (activation checkpointing wraps ``ctx.blocks``): never replace, add or rename a module or a
    parameter (``convert_model`` alone adds parameters), so that ``init_weights`` gives the
    same weights and checkpoints keep their keys whether the plugin is enabled or not. A
    wrapper must not change the forward's result, and implementations of this phase must
    commute (their result may not depend on which runs first).
    """


@hookspec
def compile_model(ctx: ModelContext) -> None:
    """Model phase 2, compile: compile the blocks (or other parts) of the wrapped model.

    Fires once per run, after every ``wrap_model``, still on the meta device and before FSDP2's
    ``fully_shard``, whose hooks (all-gather, reshard) then run around the compiled forwards,
    outside the compiled regions. Compile forwards in place with
    :func:`plugtrain.plugin.wrap_forward` (not ``Module.compile()``, which would compile the
    module's hooks too); call ``ctx.register_compiler(self)`` first: two compilers are refused,
    since they do not commute. The loss path is reachable too: the final norm is ``ctx.norm``,
    and ``ctx.loss_fn``, the training loss from logits and targets, may be replaced by a
    compiled version of itself, which the trainer then calls at every microbatch.
    """


@hookspec
def build_optimizer(ctx: OptimizerContext) -> torch.optim.Optimizer | None:
    """Return the run's optimizer, built over ``ctx.named_parameters``, or None to leave it.

    Fires once per run, after the model is sharded and materialised and before the LR schedule,
    ``setup`` and any checkpoint load. At most one plugin may answer (two are refused, naming
    both); when none does, the core builds fused AdamW from ``[optimizer]``. The optimizer must
    hold every trainable parameter exactly once (``ctx.named_parameters``: those frozen in
    ``convert_model`` are not there), and each param group's ``lr`` must be a 0-d float
    tensor on the device (``ctx.learning_rate(peak)``): the LR schedule (warmup, decay, WSD)
    scales every group's peak in place, by the same factor; the run's logged ``lr`` is group
    0's. To keep the step free of host syncs, set ``_step_supports_amp_scaling = True`` and
    honour the attributes the trainer sets around a vetoed ``step()``, as fused AdamW does:
    ``found_inf`` (a 0-d float tensor; nonzero: change no parameter and no state, decided on
    the device) and ``grad_scale`` (None); any other optimizer costs a host read at every
    step that a plugin's device flag may veto. Its ``state_dict`` is checkpointed through DCP
    (tensors and numbers only; DTensor states reshard), and a checkpoint holding another
    optimizer's state is refused on resume.
    """


@hookspec
def setup(ctx: SetupContext) -> None:
    """Prepare for the run: read the config and the resolved dtypes, allocate state.

    Fires once per run, after the model is sharded and the optimizer, LR scheduler and
    mixed-precision policy exist, before any checkpoint is loaded and before the first step.
    Read the resolved dtypes (``ctx.param_dtype``) and your config (``ctx.plugin_config(self)``)
    here and allocate what you need. A plugin with nothing to do in this run calls
    ``ctx.deactivate(self, reason)``: it is then unregistered and costs nothing.
    """


@hookspec
def build_loss(ctx: SetupContext) -> StepLoss | None:
    """Return the object that answers each microbatch's loss, or None to leave the cross-entropy.

    Fires once per run, right after ``setup`` (so the plugin has read its config and built
    what it needs, a reference model), before any checkpoint is loaded. At most one plugin may
    answer (two are refused, naming both), as ``build_optimizer`` answers the optimizer; a run
    where one answers refuses ``loss_terms`` (they are terms of the cross-entropy). The answer
    is a :class:`plugtrain.plugin.StepLoss`: at the start of every step, before any forward,
    the trainer calls ``units(microbatch)`` for each of the step's microbatches (what the loss
    is a mean over: a preference pair, a sequence; a 0-d tensor on the device), sums them over
    the microbatches and all-reduces the sum over the data-parallel ranks, on the device, once
    per step. Then, once per microbatch, ``answer(model, microbatch, index)`` runs the
    forward itself and returns the microbatch's loss **summed** over its units (0-d, in the autograd
    graph); the trainer multiplies it by ``D / N`` (``N`` the step's units, ``D`` the
    data-parallel ranks, whose gradients FSDP2 averages) and backpropagates it through
    ``pre_backward``. Summed over the microbatches and averaged over the ranks, the step's
    loss is then the mean over every unit of the step, whatever the split: never a mean of
    per-microbatch means, which weighs a unit of a microbatch with few of them more (ms-swift
    PR #10144). The logged ``loss`` is that mean. Validation passes call it too, under
    ``torch.no_grad``, on the validation batches: ``validation_loss`` is the mean over all
    their units (and no ``validation_bpb`` is logged). It may run other forwards (under
    ``torch.no_grad``) but changes no parameter of the model, and no step hook's order. Under
    tensor parallelism the model's logits are a DTensor sharded over the vocabulary, and the
    answer and its backward run inside ``loss_parallel``: its ``F.cross_entropy`` of them
    reduces over the vocabulary (``reduction="none"`` gives the replicated per-token losses,
    a DTensor: ``plugtrain.plugin.local_tensor`` of it is each rank's whole copy).
    """


@hookspec
def loss_terms(ctx: LossContext) -> Mapping[str, torch.Tensor] | None:
    """Return named terms to add to the loss, ``{"z_loss": value}``, for one microbatch.

    Fires once per microbatch, after the forward and before ``pre_backward``, and only in runs
    where a plugin implements it (otherwise the loss is computed exactly as without it). The
    plugin sees ``ctx.logits``, ``ctx.targets`` and ``ctx.lse`` (the log-sum-exp of the logits,
    computed once for all plugins, a plain tensor), not the model; ``ctx.logits`` is None when
    the loss is computed in chunks (``[model] loss_chunks``), ``ctx.lse`` is always there.
    With a mixture-of-experts model (``[model] family = "moe"``) ``ctx.router`` holds each
    expert layer's router statistics of the forward (logits and probabilities in the autograd
    graph, tokens per expert), the input of a balancing loss; the core adds its own from them
    (``[model] moe_aux_loss_weight``, ``moe_z_loss_weight``), logged as ``moe/<key>``.

    Each value is a 0-d tensor in the autograd graph: **the microbatch's share of the step's
    term**, normalised as the cross-entropy is. ``ctx.mask`` holds the targets that count
    (not ``-100``: with chat data the assistant's, with text every one) and ``ctx.count`` the
    step's count of them over every microbatch and data-parallel rank, divided by the number
    of those ranks: a per-target term returns its sum over ``ctx.mask``'s targets divided by
    ``ctx.count`` (z-loss: ``weight * (lse**2 * mask).sum() / count``), so that summed over
    the microbatches and averaged over the ranks it is the mean over every counted target of
    the step. The trainer adds it, as it is, to the loss that ``pre_backward`` sees, so a loss
    scaler scales the total. The terms are added in the order of their names, whatever the
    plugins' order. Each is logged on logging steps as ``<plugin name>/<key>``, summed over
    the microbatches and averaged over ranks like the loss; ``loss`` itself stays the
    cross-entropy.
    """


@hookspec
def pre_backward(ctx: StepContext) -> None:
    """Fires before each microbatch's ``backward()``, ``ctx.num_microbatches`` times per step.

    ``ctx.loss`` is the scalar tensor backward will run on (the microbatch's share of the
    step's loss, normalised by the step's count of counted targets: see ``loss_terms``);
    ``ctx.microbatch`` is its index. A plugin may replace ``ctx.loss`` with another tensor of
    the same graph (a loss scaler multiplies it). The trainer logs the loss as it was before
    this hook, whatever plugins do.
    """


@hookspec
def unscale_gradients(ctx: StepContext) -> None:
    """Gradient phase 1, make true: put the gradients into their true value.

    Fires once per optimizer step, after the last microbatch's backward, when the gradients are
    complete: FSDP2's reduce-scatter has finished and each rank holds its gradient shards
    (DTensors, averaged over ranks; plain tensors in a float32 run of one process, which is not
    sharded). Only a loss scaler implements it: it divides the gradients by the scale it
    multiplied the loss by in ``pre_backward`` (and finds inf/nan). Every later phase sees true
    gradients.
    """


@hookspec
def observe_gradients(ctx: StepContext) -> None:
    """Gradient phase 2, observe: read the true gradients, before anything modifies them.

    Fires once per optimizer step, after ``unscale_gradients``. Read-only: compute statistics,
    norms, spike detection, keeping the results on the device. Never modify a gradient here:
    every observer must see the same, unclipped gradients whatever the plugins' order.
    """


@hookspec
def post_backward(ctx: StepContext) -> None:
    """Gradient phase 3, modify: transform the gradients in place (clipping).

    Fires once per optimizer step, after ``observe_gradients``. The gradients are true (a loss
    scaler has unscaled them) and are DTensor shards, in fp32 under FSDP2's mixed precision
    (plain fp32 tensors in a float32 run of one process: handle both).
    Modify them in place; implementations of this phase must commute (their results may not
    depend on which runs first).
    """


@hookspec
def pre_step(ctx: StepContext) -> str | torch.Tensor | None:
    """Gradient phase 4, decide: return a veto to skip this step's optimizer update.

    Fires once per step, right before ``optimizer.step()``. Return None to let the step run, a
    0-d bool tensor on the training device (true: skip) for a decision computed from device
    values (an inf flag, a norm), or a non-empty string for a decision the host already knows,
    giving the reason. The trainer combines every veto on the device and applies the skip
    without reading it (the fused optimizer's ``found_inf``); a skipped step changes neither
    the parameters, the optimizer state, the learning-rate schedule nor a mixture of experts'
    selection bias (``[model] moe_bias_update_rate``), and the step counter
    still advances. Anything else returned is a plugin error. The core does not synchronise
    vetoes across ranks: base a veto on values that are already global (an all-reduced norm, a
    synchronised inf flag), so that every rank takes the same decision.
    """


@hookspec
def post_step(ctx: StepContext) -> None:
    """Fires once per step, after ``optimizer.step()`` or its skip, before gradients are zeroed.

    ``ctx.skipped`` is a 0-d bool tensor on the device: whether any veto skipped the step (use
    it in device arithmetic; reading it is a host sync). ``ctx.skip_reasons`` lists the string
    vetoes. A loss scaler updates its scale here.
    """


@hookspec
def step_metrics(ctx: StepContext) -> Metrics | None:
    """Fires after ``post_step`` on logging steps only (every ``metrics.log_freq`` steps).

    Return scalar metrics for this step, ``{"grad_norm": norm}``; values may be 0-d tensors
    (the trainer reads them once per logging step, so keep per-step work free of ``.item()``).
    They are logged as ``<plugin name>/<key>``; metrics should be identical on every rank.
    Every metric goes to ``metrics.jsonl``; the console line shows only those the plugin named
    in ``setup`` with ``ctx.show_on_console(self, key, ...)``
    (:meth:`plugtrain.plugin.SetupContext.show_on_console`), to stay short.
    """


@hookspec
def validation_weights() -> Sequence[str] | None:
    """Return the names of weight sets this plugin can swap in for an extra validation pass.

    Fires once each time validation is due (every ``validation.interval`` steps and at the
    end). After the pass on the model's own weights (logged as ``validation_loss``) the trainer
    runs one pass per name, logged as ``<name>/validation_loss``; use your plugin's name
    (``ctx.name_of(self)`` in ``setup``). The plugin swaps the weights in ``pre_validation`` and
    back in ``post_validation`` when ``ctx.weights`` is its name.
    """


@hookspec
def pre_validation(ctx: ValidationContext) -> None:
    """Fires before each validation pass, once per weight set each time validation is due.

    ``ctx.weights`` is None for the model's own weights, else the name of the set a plugin
    offered in ``validation_weights``; that plugin copies its weights into the model's
    parameter shards here (in place, under ``torch.no_grad``). The model's parameters are
    resharded between passes, so the pass evaluates exactly the shards as they are now.
    """


@hookspec
def validation_metrics(ctx: ValidationContext) -> Mapping[str, float | str | torch.Tensor] | None:
    """Return values measured on the weights of this validation pass, ``{"cloze/acc": 0.31}``.

    Fires once per weight set each time validation is due, after the pass's loss is computed
    (``ctx.loss``) and before ``post_validation``: whatever order the plugins are in, the
    weights of the pass (``ctx.weights``) are in the model, so a plugin evaluates them in place
    (the ``downstream_eval`` plugin scores tasks here, the ``samples`` plugin writes text), and
    the trainer reshards the model after it. Every rank calls it: forwards and collectives are
    allowed, alike on every rank, and the values (numbers, 0-d tensors read
    once, or text) must be the same on every rank. They join the pass's record in
    ``metrics.jsonl`` as ``<plugin name>/<key>`` for the model's own weights and ``<weights
    name>/<plugin name>/<key>`` for a weight set a plugin offered (``ema/downstream_eval/...``);
    the console shows those the plugin named with ``ctx.show_on_console``.
    """


@hookspec
def post_validation(ctx: ValidationContext) -> None:
    """Fires after each validation pass, once per weight set each time validation is due.

    ``ctx.loss`` is the pass's loss (a float, the mean over batches and ranks). The plugin that
    swapped its weights in ``pre_validation`` puts the model's own back here: training
    continues from the parameters as this hook leaves them. Values a plugin measures are
    returned from ``validation_metrics``.
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

    Fires at most once per run, after ``setup``, only if the checkpoint holds state for this
    plugin; a plugin whose state is absent (the checkpoint was made without it, or while it was
    deactivated) keeps the state ``setup`` gave it.
    """


@hookspec
def checkpoint_saved(folder: Path, step: int) -> None:
    """Fires once per checkpoint, on every rank, once checkpoint ``folder`` of ``step`` is complete.

    The folder (``<dump_folder>/checkpoints/step-<N>``; a ``str`` URL when ``job.dump_folder``
    is one, beside which nothing can be written) is committed and visible to every rank
    when this fires: a plugin may read it or write beside its files (an export), with
    collectives, since every rank calls it at the same point. With ``checkpoint.async_mode
    async`` the write finishes in the background and the hook fires when the trainer next waits
    for it: before the next save begins, or at the end of the run; the training state may have
    moved on since ``step``, so read what belongs to ``step`` from the folder.
    """


@hookspec
def checkpoint_loaded(folder: Path, step: int) -> None:
    """Fires once per run that resumes, on every rank, after checkpoint ``folder`` is loaded.

    The model, optimizer, the core's state and every plugin's ``load_state_dict`` have been
    restored from ``folder`` (of ``step``). A plugin whose state the checkpoint did not hold
    (its ``load_state_dict`` did not fire) can derive it from the loaded model here.
    """
