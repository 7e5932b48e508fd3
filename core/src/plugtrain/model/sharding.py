"""The model as a run trains it: built on meta, tensor-parallel, FSDP2-sharded, initialised."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from plugtrain.model.conversion import conversion_of
from plugtrain.model.init import fill_parameter, initialize
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
) -> MixedPrecisionPolicy:
    """Apply FSDP2 to each transformer block, then to the root; return the policy used.

    A 1-D ``mesh`` shards every parameter over all its ranks (FSDP); a 2-D one,
    ``("dp_replicate", "dp_shard")``, shards it within each row and keeps one copy per row
    (HSDP: gradients are reduce-scattered within a row, then all-reduced across rows).
    Under expert parallelism the routed experts are sharded first, over ``experts_mesh``
    (``model.moe.expert_parallel.shard_experts``).
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
        fully_shard(
            block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(layers) - 1,
            ignored_params=ignored,
        )  # fmt: skip
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored)
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
    the shards as they are then (a no-op for modules already resharded)."""
    for module in model.modules():
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
) -> nn.Module:
    """Build family ``spec``'s model of shape ``args`` on the meta device, ``transform`` it,
    split it over ``tp_mesh`` (its TP plan, if given), split its experts over the first of
    ``ep_meshes`` (``ep``, if given) and shard them over the second (``dp_shard_mod_ep``),
    shard the rest over ``mesh``, then materialise and initialise it (its init plan).

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
    experts_mesh = None
    if ep_meshes is not None:
        parallelize_experts(model, ep_meshes[0], spec.name)
        experts_mesh = ep_meshes[1]
    conversion.store_meta(model)
    shard_model(model, mesh, param_dtype, reduce_dtype, experts_mesh)
    model.to_empty(device=device)
    # The parameters a plugin added come after the family's own, whose draws they leave as
    # they are without the plugin.
    plan, added = spec.init_plan(model), conversion.init_plan(model)
    if init_weights:
        stored = {
            id(param): functools.partial(conversion.load_stored, model, name)
            for name, param in model.named_parameters()
            if name in conversion.stored
        }
        initialize(model, [*plan, *added], seed, stored)
    else:  # the loaded weights have no place for the added ones: drawn as initialize would
        for index, (param, fill) in enumerate(added, start=len(plan)):
            fill_parameter(param, fill, seed, index)
    model.init_buffers()
    return model
