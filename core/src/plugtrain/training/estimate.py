"""A run's memory estimate: its config's model, batch, dtypes and checkpointing on N processes.

:func:`estimate_run` reads what the family's memory formula (``ModelSpec.memory``) needs from a
config (the tokenizer's vocabulary, the microbatch, the mesh, the activation checkpointing
plugin's section) and refuses what a run would refuse; the formulas are each family's (Llama's
in :mod:`plugtrain.model.llama.memory`). For ``plugtrain estimate`` and the trainer's start-up
line.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

from plugtrain import sample
from plugtrain.config import JobConfig
from plugtrain.data import Tokenizer
from plugtrain.distributed import parallel_dims
from plugtrain.errors import ConfigError
from plugtrain.model import Checkpointing, MemoryEstimate, conversion_of, model_spec, size_text
from plugtrain.model.moe.expert_parallel import check_expert_parallel
from plugtrain.training.conversion import converted_model
from plugtrain.training.layout import check_context_parallel
from plugtrain.training.pipeline import pipeline_placement
from plugtrain.training.pipeline_plan import bubble_fraction, check_pipeline, pipeline_share

if TYPE_CHECKING:
    from torch import nn

    from plugtrain.host import PluginHost

__all__ = ["checkpointing_of", "converted_estimate", "estimate_run", "pipeline_estimate"]

CHECKPOINTING_PLUGIN = "activation_checkpointing"
"""The plugin whose config section says what activation checkpointing a run does."""


def checkpointing_of(config: JobConfig) -> Checkpointing:
    """The activation checkpointing ``config`` asks for, from the plugin's section if enabled.

    Read by field name, as the plugin declares them (``mode``, ``selective_by``, ``every``):
    the core imports no plugin.
    """
    if CHECKPOINTING_PLUGIN not in config.plugin_sections:
        return Checkpointing()
    section = config.plugin(CHECKPOINTING_PLUGIN)
    if section.mode == "full":
        return Checkpointing("full")
    if section.selective_by == "op":
        return Checkpointing("op")
    return Checkpointing("layer", section.every)


def converted_estimate(estimate: MemoryEstimate, model: nn.Module) -> MemoryEstimate:
    """``estimate`` (the family's formula, for its own parameters) for ``model`` as plugins
    converted it: parameters for all of them (those held in another form at its bytes, QLoRA's
    NF4 base), gradients and AdamW's moments for the trainable ones only (full sizes, however
    ``model`` is sharded)."""
    conversion = conversion_of(model)
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    base = total - sum(params[name].numel() for name in conversion.added)
    trained = sum(p.numel() for p in params.values() if p.requires_grad)
    held = sum(params[name].numel() for name in conversion.stored)
    held_bytes = sum(s.nbytes(tuple(params[n].shape)) for n, s in conversion.stored.items())
    # Bytes, where the formula counts 4 a parameter.
    counts = {
        "parameters": 4 * (total - held) + held_bytes,
        "gradients": 4 * trained,
        "optimizer": 4 * trained,
    }
    held_as = ""
    if held:
        forms = "/".join(sorted({storage.name for storage in conversion.stored.values()}))
        held_as = f"; {held:,} frozen held as {forms}, {held_bytes / held:.2f} bytes each"
    parts = tuple(
        (
            name,
            size * counts[name] // (4 * base) if name in counts else size,
            what + (held_as if name == "parameters" else ""),
        )
        for name, size, what in estimate.parts
    )
    return dataclasses.replace(estimate, parts=parts)


def estimate_run(
    config: JobConfig,
    world_size: int,
    vocab_size: int | None = None,
    model: nn.Module | None = None,
    host: PluginHost | None = None,
) -> MemoryEstimate:
    """The memory formula of ``config``'s model family (``ModelSpec.memory``) for ``config``
    on ``world_size`` processes.

    ``model``, the run's (meta-device or built) after ``convert_model``, gives the parameters
    a plugin added or froze: gradients and optimizer states count the trainable ones only.
    Without it, ``host``'s plugins convert a meta-device model (``plugtrain estimate``).

    ``vocab_size`` is the tokenizer's; by default it is read from ``model.tokenizer_path``, or,
    where that file does not exist, the flavor's is used (and the estimate says so). With flavor
    ``hf`` the embedding has config.json's rows whatever the tokenizer.
    """
    train = config.training
    # Degrees a run on world_size processes would refuse are refused here too.
    dims = parallel_dims(config.parallelism, world_size)
    data_ranks = dims.dp_size  # a tp group's ranks read the same batches
    parts = data_ranks * train.grad_accum_steps
    if train.batch_size % parts:
        raise ConfigError(
            f"training.batch_size {train.batch_size} is not divisible by data-parallel ranks * "
            f"grad_accum_steps = {data_ranks} * {train.grad_accum_steps} = {parts}: set "
            f"training.batch_size to a multiple of {parts} or change grad_accum_steps"
        )
    whose = ""
    if vocab_size is None and sample.resolve(config.model.tokenizer_path).is_file():
        vocab_size = Tokenizer.from_file(config.model.tokenizer_path).vocab_size
    if vocab_size is None and config.model.flavor != "hf":
        whose = f" (the flavor's: {config.model.tokenizer_path} not found)"
    spec = model_spec(config.model.family)
    args = config.model.model_args(vocab_size, train.seq_len)
    spec.check_parallel(args, dims.tp, train.seq_len)
    if dims.ep_enabled:
        experts = getattr(args, "num_experts", 0)
        check_expert_parallel(dims.ep, [experts] if experts else [], config.model.family)
    if dims.pp_enabled:
        check_pipeline(
            args.n_layers,
            config.parallelism.pp_schedule,
            dims.pp,
            config.parallelism.stages_per_rank,
            train.grad_accum_steps,
        )
        pipeline_placement(config, dims, spec)  # what the runtime refuses under pp
    check_context_parallel(config, dims, spec)
    if model is None and host is not None and host.implementers("convert_model"):
        model = converted_model(config, host, args)
    formula = functools.partial(
        spec.memory,
        args,
        world_size=world_size,
        microbatch=train.batch_size // parts,
        # Under context parallelism each rank holds the activations of its part of a row.
        seq_len=train.seq_len // dims.cp,
        param_dtype=train.mixed_precision_param,
        reduce_dtype=train.mixed_precision_reduce,
        checkpointing=checkpointing_of(config),
        dp_replicate=dims.dp_replicate,
        tp=dims.tp,
        loss_chunks=config.model.loss_chunks,
    )
    estimate = pipeline_estimate(config, dims.pp, formula) if dims.pp_enabled else formula()
    if model is not None:
        estimate = converted_estimate(estimate, model)
    setting = f"{config.model.flavor} model, vocab {args.vocab_size}{whose}, {estimate.setting}"
    return dataclasses.replace(estimate, setting=setting)


def pipeline_estimate(
    config: JobConfig, pp: int, formula: Callable[..., MemoryEstimate]
) -> MemoryEstimate:
    """The estimate of the pipeline rank that holds the most (``formula``, the family's memory
    formula with the run's arguments, called with each rank's ``pipeline`` share), followed by
    the schedule's bubble in theory and every rank's total."""
    parallelism, microbatches = config.parallelism, config.training.grad_accum_steps
    schedule, per_rank = parallelism.pp_schedule, parallelism.stages_per_rank
    ranks = [
        formula(pipeline=pipeline_share(schedule, pp, per_rank, microbatches, rank))
        for rank in range(pp)
    ]
    largest = max(range(pp), key=lambda rank: ranks[rank].total)
    bubble = bubble_fraction(schedule, pp, per_rank, microbatches)
    totals = ", ".join(f"{rank}: {size_text(e.total)}" for rank, e in enumerate(ranks))
    notes = (
        f"pipeline: {schedule}, {pp} ranks x {per_rank} stage(s), {microbatches} microbatches: "
        f"bubble {bubble} = {float(bubble):.1%} of a step in theory "
        "(plugtrain/training/pipeline_plan.py)",
        f"total per pipeline rank (the largest above): {totals}",
    )
    return dataclasses.replace(ranks[largest], notes=notes)
