"""The process group and :class:`ParallelDims`: the job's degrees, meshes and ranks by name.

The same for one process or many, on one machine or many.
Plain ``python train.py`` runs as a world of one process (a private in-memory store, no ports);
``torchrun`` gives N processes on one or several machines.
CPU uses the gloo backend, CUDA uses NCCL. One device mesh is built, its dimensions those in use:
``("dp_shard",)`` for FSDP over every rank, ``("dp_replicate", "dp_shard")`` for hybrid sharding
(``[parallelism]``), ``("dp_replicate", "dp_shard", "tp")`` with tensor parallelism (the ``tp``
ranks consecutive: the GPUs of one node), ``("dp_shard_mod_ep", "ep")`` with expert parallelism
(``dp_shard`` their flattening: the ``ep`` ranks consecutive), and ``"pp"`` in front of them with
pipeline parallelism (each stage's ranks consecutive). Each named dimension, and the
data-parallel one (``"dp"``: every dimension but ``pp`` and ``tp``), is sliced from it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plugtrain.errors import ConfigError

DIMENSIONS = ("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")
"""The named parallel dimensions, outermost first. ``ep`` (expert parallelism) is carved out of
``dp_shard``: its ranks are the innermost ``ep`` of a ``dp_shard`` group."""

SHARD_CP = "dp_shard_cp"
"""The mesh dimension, under context parallelism, of ``dp_shard`` and ``cp`` flattened: FSDP
shards over it, and a value of the tokens (a loss's count) is reduced over it."""

EXPERT_SHARD = "dp_shard_mod_ep"
"""The mesh dimension, under expert parallelism, of the ``dp_shard / ep`` ranks that hold the
same experts: FSDP shards the experts over it (torchtitan's name)."""


CPU = torch.device("cpu")
"""The device of a :class:`ParallelDims` built without one (a unit-test context, an estimate)."""


class Degrees(Protocol):
    """The degrees a run asks for: the ``[parallelism]`` section (``dp_shard`` -1: the rest)."""

    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    pp: int
    cp: int


@dataclass(frozen=True)
class ParallelDims:
    """This process's place in the job: each parallel dimension's degree, this rank's index in
    it, and its device mesh, by name (:data:`DIMENSIONS`, and ``"dp"``: the data-parallel ranks).

    The ranks are laid out row-major over ``pp x dp_replicate x dp_shard x cp x tp`` (``tp``
    innermost: consecutive ranks). The ranks of one ``tp`` group, of one line of ``pp`` stages
    and of one ``cp`` group read the same batches (a ``cp`` group each its part of every
    sequence); the data-parallel ones, ``dp_replicate x dp_shard``, read different ones.
    """

    dp_replicate: int = 1
    """Copies of the sharded model (HSDP's replicas); 1 under plain FSDP."""
    dp_shard: int = 1
    """Ranks each copy of the model is sharded over (FSDP2), resolved (never -1)."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split each projection and read the same data."""
    pp: int = 1
    """Pipeline-parallel degree: the ranks a line of pipeline stages spans, each holding its
    own stages of the model."""
    ep: int = 1
    """Expert-parallel degree, a divisor of ``dp_shard``: the ranks that split each layer's
    routed experts."""
    cp: int = 1
    """Context-parallel degree: the ranks that split every sequence of a batch they share."""
    rank: int = 0
    """This process's rank in the world."""
    local_rank: int = 0
    """Its rank on its machine (``LOCAL_RANK``): the GPU it uses."""
    device: torch.device = CPU
    """The device this process trains on."""
    root: DeviceMesh | None = field(default=None, repr=False, compare=False)
    """The job's device mesh, its dimensions those in use; None where no process group was
    joined (a unit-test context): :meth:`get_mesh` then refuses."""

    def __post_init__(self) -> None:
        if self.dp_shard % self.ep:
            raise ConfigError(
                f"parallelism.ep = {self.ep} does not divide dp_shard = {self.dp_shard} (expert "
                f"parallelism is carved out of dp_shard): choose an ep that divides {self.dp_shard}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")

    @property
    def world_size(self) -> int:
        """Every rank of the job: the product of the degrees (``ep`` lies inside ``dp_shard``)."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the one that writes the run's files and logs."""
        return self.rank == 0

    def size(self, name: str) -> int:
        """The degree of dimension ``name`` (:data:`DIMENSIONS`, or ``"dp"``)."""
        if name == "dp":
            return self.dp_replicate * self.dp_shard
        if name not in DIMENSIONS:
            raise ValueError(f"no parallel dimension '{name}': choose one of dp, {DIMENSIONS}")
        return int(getattr(self, name))

    def rank_in(self, name: str) -> int:
        """This rank's index in dimension ``name`` (:data:`DIMENSIONS`, or ``"dp"``), in
        ``[0, size(name))``."""
        if name == "ep":
            return self.rank_in("dp_shard") % self.ep
        if name == "dp":
            return self.rank_in("dp_replicate") * self.dp_shard + self.rank_in("dp_shard")
        inner = 1  # the ranks one step along ``name`` spans: the product of the inner degrees
        for other in reversed(DIMENSIONS):
            if other == name:
                return self.rank // inner % self.size(name)
            inner *= 1 if other == "ep" else self.size(other)
        raise ValueError(f"no parallel dimension '{name}': choose one of dp, {DIMENSIONS}")

    @property
    def dp_size(self) -> int:
        """The ranks that train on different data: ``dp_replicate x dp_shard``."""
        return self.size("dp")

    @property
    def dp_rank(self) -> int:
        """This rank's place among the :attr:`dp_size` ranks that train on different data."""
        return self.rank_in("dp")

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    def get_mesh(self, name: str) -> DeviceMesh:
        """The 1-D mesh of dimension ``name``, or for ``"dp"`` the data-parallel mesh FSDP2
        shards over: ``("dp_shard",)``, ``("dp_replicate", "dp_shard")`` under HSDP, or
        :data:`SHARD_CP` under context parallelism (its ranks hold different tokens).

        A dimension that is not in this run's mesh (``tp`` without tensor parallelism,
        ``dp_replicate`` without HSDP, ``ep`` without expert parallelism, ``pp`` without a
        pipeline, ``cp`` without context parallelism) is refused in one line. Under expert
        parallelism there is also :data:`EXPERT_SHARD`.
        """
        if self.root is None:
            raise ValueError(
                f"no '{name}' mesh: these ParallelDims were built without a process group "
                f"(a unit-test context); use a real run (plugtrain.testing.tiny_run)"
            )
        names = self.root.mesh_dim_names or ()
        if self.ep_enabled and name in ("dp", "dp_shard"):
            # The flattening _device_mesh made (returned again, not made anew): slicing a
            # flattened name from the root warns of its deprecation.
            return self.root[(EXPERT_SHARD, "ep")]._flatten("dp_shard")
        if name == "dp" and self.cp_enabled:
            return self.root[("dp_shard", "cp")]._flatten(SHARD_CP)  # made by _device_mesh
        if name == "dp":
            data_parallel = tuple(n for n in names if n not in ("pp", "tp"))
            return self.root if data_parallel == names else self.root[data_parallel]
        if name not in names:
            raise ValueError(
                f"the '{name}' mesh dimension is disabled in this run (its degree is "
                f"{self.size(name)}); this run's mesh has {names}"
            )
        return self.root if names == (name,) else self.root[name]

    def expert_meshes(self) -> tuple[DeviceMesh, DeviceMesh] | None:
        """Under expert parallelism, the meshes the experts are split over (``ep``) and
        FSDP-sharded over (:data:`EXPERT_SHARD`), for ``model.build_model``; else None."""
        return (self.get_mesh("ep"), self.get_mesh(EXPERT_SHARD)) if self.ep_enabled else None


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
    world_size: int,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
) -> tuple[int, ...]:
    """The mesh's shape for ``parallelism.dp_replicate``, ``dp_shard``, ``tp``, ``pp`` and
    ``cp`` on ``world_size`` ranks: ``(world_size,)`` for plain FSDP, ``(dp_replicate,
    dp_shard)`` for HSDP, ``(dp_replicate, dp_shard, tp)`` with tensor parallelism, ``pp`` in
    front with pipeline parallelism, ``(dp_shard, cp)`` with context parallelism.

    Degrees whose product is not the world size are refused in one line naming them.
    """
    if pp > 1:
        if world_size % pp:
            raise ConfigError(
                f"parallelism.pp = {pp} does not divide the world size {world_size}: launch a "
                f"multiple of {pp} processes, or set pp to a divisor of {world_size}"
            )
        return (pp, *mesh_shape(world_size // pp, dp_replicate, dp_shard, tp, cp=cp))
    if cp > 1:
        if world_size % cp:
            raise ConfigError(
                f"parallelism.cp = {cp} does not divide the world size {world_size}: launch a "
                f"multiple of {cp} processes, or set cp to a divisor of {world_size}"
            )
        return (*mesh_shape(world_size // cp, dp_replicate, dp_shard, tp), cp)
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


def parallel_dims(
    degrees: Degrees,
    world_size: int,
    *,
    rank: int = 0,
    local_rank: int = 0,
    device: torch.device = CPU,
) -> ParallelDims:
    """The :class:`ParallelDims` of ``degrees`` (the ``[parallelism]`` section) on ``world_size``
    ranks, without a mesh: the degrees checked as :func:`mesh_shape` checks them, ``dp_shard``
    resolved. Expert parallelism with tensor, hybrid or pipeline parallelism, and context
    parallelism with any of those or expert parallelism, are refused in one line (not composed
    yet)."""
    ep, pp, cp, tp, replicate = (
        degrees.ep, degrees.pp, degrees.cp, degrees.tp, degrees.dp_replicate
    )  # fmt: skip
    for outer, degree_of, others in (
        ("ep", ep, (("tp", tp), ("dp_replicate", replicate), ("pp", pp))),
        ("cp", cp, (("tp", tp), ("dp_replicate", replicate), ("pp", pp), ("ep", ep))),
    ):
        for name, degree in others:
            if degree_of > 1 and degree > 1:
                full = {"ep": "expert", "cp": "context"}[outer]
                raise ConfigError(
                    f"parallelism.{outer} = {degree_of} with {name} = {degree}: {full} "
                    f"parallelism does not compose with {name} yet; set parallelism.{name} = "
                    f"1, or {outer} = 1"
                )
    mesh_shape(world_size, replicate, degrees.dp_shard, tp, pp, cp)
    dp_shard = degrees.dp_shard
    if dp_shard == -1:
        dp_shard = world_size // (pp * replicate * cp * tp)
    return ParallelDims(
        replicate, dp_shard, tp, pp=pp, ep=ep, cp=cp, rank=rank, local_rank=local_rank,
        device=device,
    )  # fmt: skip


def init_parallel_dims(device_choice: str, degrees: Degrees) -> ParallelDims:
    """Join (or, for a plain ``python`` launch, create) the process group and build the job's
    :class:`ParallelDims` from ``degrees`` (the ``[parallelism]`` section), with its one mesh:
    the run's single builder of its degrees, meshes and ranks."""
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
    dims = parallel_dims(
        degrees,
        dist.get_world_size(),
        rank=dist.get_rank(),
        local_rank=local_rank,
        device=device,
    )
    return dataclasses.replace(dims, root=_device_mesh(dims, device.type))


def _device_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The job's one mesh, sliced: FSDP2 over the data-parallel slice of parameters that
    tensor (or expert) parallelism made DTensors over the "tp" (or "ep") slice needs both to
    share their root."""
    if dims.ep_enabled:
        # The experts: FSDP over EXPERT_SHARD, split over "ep"; the dense parameters: FSDP over
        # both, flattened into "dp_shard" (the same ranks, in the same order, as without EP).
        names = (EXPERT_SHARD, "ep")
        root = init_device_mesh(
            device_type, (dims.dp_shard // dims.ep, dims.ep), mesh_dim_names=names
        )
        root[names]._flatten("dp_shard")
        return root
    names = ("dp_replicate", "dp_shard", "tp")
    if not dims.tp_enabled:
        names = names[:2] if dims.dp_replicate_enabled else ("dp_shard",)
    if dims.pp_enabled:
        names = ("pp", *names)
    if dims.cp_enabled:  # FSDP over dp_shard x cp, flattened (torchtitan's dp_shard_cp)
        root = init_device_mesh(
            device_type, (dims.dp_shard, dims.cp), mesh_dim_names=("dp_shard", "cp")
        )
        root[("dp_shard", "cp")]._flatten(SHARD_CP)
        return root
    shape = tuple(dims.size(name) for name in names)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


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
