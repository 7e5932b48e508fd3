"""The model as a run trains it: built on meta, tensor-parallel, FSDP2-sharded, initialised."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from plugtrain.model.context_parallel import parallelize_context
from plugtrain.model.conversion import conversion_of
from plugtrain.model.init import fill_parameter
from plugtrain.model.moe.expert_parallel import parallelize_experts, shard_experts
from plugtrain.model.spec import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The config's dtype names (``training.mixed_precision_*``) as torch dtypes."""


def needs_sharding(world_size: int, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> bool:
    """Whether FSDP2 has work to do: several ranks, or a mixed-precision cast to apply.

    One process in float32 has nothing to shard and nothing to cast, yet FSDP2 would copy
    every block into an unsharded buffer and the gradients back at each step (the measured cost
    is in docs/benchmarks/speed.md): the plain module computes the same numbers without it.
    Checkpoints stay interchangeable: DCP saves plain tensors and DTensors under the same keys
    and reshards between them.
    """
    return world_size > 1 or param_dtype != torch.float32 or reduce_dtype != torch.float32


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    experts_mesh: DeviceMesh | None = None,
    stages: Sequence[nn.Module] | None = None,
) -> MixedPrecisionPolicy:
    """Apply FSDP2 to each transformer block, then to the root; return the policy used.

    A 1-D ``mesh`` shards every parameter over all its ranks (FSDP); a 2-D one,
    ``("dp_replicate", "dp_shard")``, shards it within each row and keeps one copy per row
    (HSDP: gradients are reduce-scattered within a row, then all-reduced across rows).
    Under expert parallelism the routed experts are sharded first, over ``experts_mesh``
    (``model.moe.expert_parallel.shard_experts``).
    A pipeline rank's part (``stages``, its views) has each of its stages sharded as a root
    of its own, and no block resharded after forward: the schedules run several microbatches'
    forwards before their backwards, and the zero-bubble ones take the weight gradients apart
    from the input gradients, which resharded parameters leave out silently (PiPPy #1105).
    Nothing is applied where :func:`needs_sharding` says there is nothing to do: the
    parameters then stay plain tensors.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if not needs_sharding(mesh.size(), param_dtype, reduce_dtype):
        return policy
    if experts_mesh is not None:
        shard_experts(model, experts_mesh, policy, mesh.size() // experts_mesh.size())
    ignored: set[nn.Parameter] | None = None
    if mesh.size(mesh.ndim - 1) == 1:
        # NOTE: FSDP2 (torch 2.13) unshards on one shard by copying a parameter's first
        # all-gather input only, which breaks a stored form with all-gather extensions (NF4):
        # unsharded anyway, such parameters stay out of FSDP2, whole on each rank.
        stored = conversion_of(model).stored
        ignored = {p for name, p in model.named_parameters() if name in stored} or None
    layers = list(model.layers.values())
    for i, block in enumerate(layers):
        # The last block stays gathered after forward, since backward needs it at once.
        reshard = stages is None and i < len(layers) - 1
        fully_shard(
            block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard,
            ignored_params=ignored,
        )  # fmt: skip
    for root in [model] if stages is None else stages:
        fully_shard(root, mesh=mesh, mp_policy=policy, ignored_params=ignored)
    return policy


def replica_sync(model: nn.Module, mesh: DeviceMesh) -> Callable[[bool], None]:
    """The switch of HSDP's gradient all-reduce across replicas, for gradient accumulation.

    Call it with False before the backward of every microbatch but the last and with True
    before the last: FSDP2 then keeps the microbatches' reduce-scattered gradients on each
    rank and all-reduces their sum once per optimizer step, not once per microbatch. A no-op
    (nothing to switch) on a 1-D mesh.
    """
    hsdp = mesh.ndim > 1
    modules = [m for m in model.modules() if hsdp and isinstance(m, FSDPModule)]

    def switch(all_reduce: bool) -> None:
        for module in modules:
            module.set_requires_all_reduce(all_reduce, recurse=False)

    return switch


def reshard(model: nn.Module) -> None:
    """Free every unsharded parameter FSDP2 still holds, so that the next forward all-gathers
    the shards as they are then (a no-op for modules already resharded); a pipeline rank's
    stages' too."""
    for stage in pipeline_stages(model):
        for module in stage.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def build_model(
    spec: ModelSpec,
    args: Any,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    device: torch.device,
    seed: int,
    transform: Callable[[nn.Module], None] | None = None,
    init_weights: bool = True,
    tp_mesh: DeviceMesh | None = None,
    ep_meshes: tuple[DeviceMesh, DeviceMesh] | None = None,
    pipeline: tuple[int, Sequence[int]] | None = None,
    context: tuple[dist.ProcessGroup, str] | None = None,
) -> nn.Module:
    """Build family ``spec``'s model of shape ``args`` on the meta device, ``transform`` it,
    split it over ``tp_mesh`` (its TP plan, if given), split its experts over the first of
    ``ep_meshes`` (``ep``, if given) and shard them over the second (``dp_shard_mod_ep``),
    shard the rest over ``mesh``, then materialise and initialise it (its init plan).
    ``pipeline`` (stages, this rank's stage indices) prunes it into this rank's part of a
    pipeline (``ModelSpec.pipeline_split``) before it is sharded: the stages it runs are then
    :func:`pipeline_stages`. ``context`` (the ``cp`` group, ``cp_method``) makes its
    attention context parallel (``model.context_parallel``).

    ``transform`` (the plugins' model hooks) sees the unsharded model on the meta device and
    changes it in place; the parameters a plugin added there (``model/conversion.py``) are
    placed by their own tensor-parallel styles and initialised by their own fills, after
    the model's own, also when ``init_weights`` is False. No rank ever holds the full model,
    and ``init_weights`` gives the same weights whatever the world size. ``init_weights=False``
    leaves the model's own parameters uninitialised (empty memory) for a caller that loads
    them (the initial load).
    """
    with torch.device("meta"):
        model = spec.build(args)
    if transform is not None:
        transform(model)
    conversion = conversion_of(model)
    if tp_mesh is not None:
        with conversion.tensor_parallel(model, tp_mesh):
            spec.parallelize(model, tp_mesh)
    if context is not None:
        parallelize_context(model, *context)
    experts_mesh = None
    if ep_meshes is not None:
        parallelize_experts(model, ep_meshes[0], spec.name)
        experts_mesh = ep_meshes[1]
    conversion.store_meta(model)
    # By name, on the whole model: a pipeline rank's part draws each parameter it holds from
    # its index in the whole model's plan. A plugin's added parameters come after the family's
    # own, whose draws they leave as they are without the plugin.
    own = [(param, fill) for param, fill in spec.init_plan(model)]
    names = {id(param): name for name, param in model.named_parameters()}
    plan = [(names[id(param)], fill) for param, fill in [*own, *conversion.init_plan(model)]]
    stages = None if pipeline is None else spec.pipeline_split(model, *pipeline)
    shard_model(model, mesh, param_dtype, reduce_dtype, experts_mesh, stages)
    model.to_empty(device=device)
    params = dict(model.named_parameters())
    held = [(index, name, fill) for index, (name, fill) in enumerate(plan) if name in params]
    if len(held) != len(params) or len(plan) != len(set(name for name, _ in plan)):
        missing = sorted(set(params) - {name for _, name, _ in held})
        raise RuntimeError(f"init_plan does not cover each parameter exactly once: {missing}")
    for index, name, fill in held:
        # Without init_weights only the added parameters, which loaded weights have no place for.
        if init_weights or index >= len(own):
            store = None
            if name in conversion.stored:
                store = functools.partial(conversion.load_stored, model, name)
            fill_parameter(params[name], fill, seed, index, store)
    model.init_buffers()
    if stages is not None:
        for stage in stages:  # its own RoPE buffer; its modules are the model's, filled above
            stage.to_empty(device=device, recurse=False)
            stage.init_buffers()
        object.__setattr__(model, _STAGES, tuple(stages))
    return model


_STAGES = "_plugtrain_pipeline_stages"


def pipeline_stages(model: nn.Module) -> tuple[nn.Module, ...]:
    """The pipeline stages this rank runs of ``model`` (built by :func:`build_model`), each a
    view sharing its modules; ``(model,)`` for a model that is not split."""
    return getattr(model, _STAGES, (model,))
