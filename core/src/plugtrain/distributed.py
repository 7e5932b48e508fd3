"""The process group and device mesh, the same for one process or many, on one machine or many.

Plain ``python train.py`` runs as a world of one process (a private in-memory store, no ports);
``torchrun`` gives N processes on one or several machines.
CPU uses the gloo backend, CUDA uses NCCL. The data-parallel mesh is 1-D, ``("dp_shard",)``, for
FSDP over every rank, and 2-D, ``("dp_replicate", "dp_shard")``, for hybrid sharding
(``[parallelism]``). With tensor parallelism one 3-D mesh, ``("dp_replicate", "dp_shard", "tp")``,
is built and both are sliced from it: the data-parallel mesh and the ``"tp"`` one (consecutive
ranks, the GPUs of one node).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plugtrain.errors import ConfigError


@dataclass(frozen=True)
class World:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    """The data-parallel mesh the model is sharded over, 1-D or 2-D: every rank, or under
    tensor parallelism the ranks that share this rank's place in its ``tp`` group."""
    tp_mesh: DeviceMesh | None = None
    """The 1-D ``"tp"`` mesh of the ranks that split this rank's model (``parallelism.tp > 1``);
    None without tensor parallelism."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (1 without)."""
        return 1 if self.tp_mesh is None else self.tp_mesh.size()

    @property
    def dp_rank(self) -> int:
        """This rank's place among the ranks that train on different data: a ``tp`` group's
        ranks are consecutive and read the same batches."""
        return self.rank // self.tp

    @property
    def dp_size(self) -> int:
        """The number of ranks that train on different data: the world size over ``tp``."""
        return self.world_size // self.tp


def resolve_device(choice: str) -> torch.device:
    """``training.device`` as a device: ``auto`` is CUDA when available, else CPU."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "config key 'training.device' is 'cuda' but no CUDA device is available: "
            "use --training.device cpu"
        )
    return torch.device(choice)


def mesh_shape(
    world_size: int, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1
) -> tuple[int, ...]:
    """The mesh's shape for ``parallelism.dp_replicate``, ``dp_shard`` and ``tp`` on
    ``world_size`` ranks: ``(world_size,)`` for plain FSDP, ``(dp_replicate, dp_shard)`` for
    HSDP, ``(dp_replicate, dp_shard, tp)`` with tensor parallelism.

    Degrees whose product is not the world size are refused in one line naming them.
    """
    if tp > 1:
        if world_size % tp:
            raise ConfigError(
                f"parallelism.tp = {tp} does not divide the world size {world_size}: launch a "
                f"multiple of {tp} processes, or set tp to a divisor of {world_size}"
            )
        data_parallel = mesh_shape(world_size // tp, dp_replicate, dp_shard)
        return (dp_replicate, data_parallel[-1], tp)
    if dp_replicate > 1 and world_size == 1:
        raise ConfigError(
            f"parallelism.dp_replicate = {dp_replicate} needs several processes but this run "
            f"has one: launch with torchrun (a multiple of {dp_replicate} processes), or set "
            f"dp_replicate = 1"
        )
    if dp_shard == -1:
        if world_size % dp_replicate:
            raise ConfigError(
                f"parallelism.dp_replicate = {dp_replicate} (with dp_shard = -1, the rest) does "
                f"not divide the world size {world_size}: set dp_replicate to a divisor of "
                f"{world_size}"
            )
        dp_shard = world_size // dp_replicate
    elif dp_replicate * dp_shard != world_size:
        raise ConfigError(
            f"parallelism.dp_replicate = {dp_replicate} x dp_shard = {dp_shard} is "
            f"{dp_replicate * dp_shard} processes but the world size is {world_size}: choose "
            f"degrees whose product is {world_size} (dp_shard = -1 takes the rest)"
        )
    return (world_size,) if dp_replicate == 1 else (dp_replicate, dp_shard)


def init_world(device_choice: str, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1) -> World:
    """Join (or, for a plain ``python`` launch, create) the process group and the device mesh
    (:func:`mesh_shape` says which)."""
    device = resolve_device(device_choice)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" in os.environ:  # launched by torchrun: env:// rendezvous
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:
            # A private HashStore makes a one-process group without opening a port, so
            # the single-process run takes exactly the same FSDP2 code path as torchrun's.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world_size = dist.get_world_size()
    shape = mesh_shape(world_size, dp_replicate, dp_shard, tp)
    if len(shape) == 3:
        # One mesh, sliced: FSDP2 over the data-parallel slice of parameters that tensor
        # parallelism made DTensors over the "tp" slice needs both to share their root.
        names = ("dp_replicate", "dp_shard", "tp")
        root = init_device_mesh(device.type, shape, mesh_dim_names=names)
        data_parallel = root["dp_shard"] if dp_replicate == 1 else root["dp_replicate", "dp_shard"]
        return World(dist.get_rank(), world_size, local_rank, device, data_parallel, root["tp"])
    names = ("dp_shard",) if len(shape) == 1 else ("dp_replicate", "dp_shard")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    return World(dist.get_rank(), world_size, local_rank, device, mesh)


def all_reduce_mean(values: torch.Tensor, world_size: int) -> torch.Tensor:
    """Mean over ranks of a tensor (in place); a no-op in a world of one."""
    if world_size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= world_size
    return values


def destroy_world() -> None:
    """Leave the process group (idempotent)."""
    if dist.is_initialized():
        # NOTE: without a barrier a fast rank can tear gloo's connections down while a slow
        # one still uses them, and the slow one aborts ("terminate called without an active
        # exception") after a successful run.
        dist.barrier()
        dist.destroy_process_group()
