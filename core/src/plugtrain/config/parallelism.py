"""The [parallelism] section: how the ranks split the model: FSDP, HSDP, TP, EP, PP and CP."""

from __future__ import annotations

from dataclasses import dataclass

from plugtrain.errors import check_field

PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
"""The pipeline schedules ``pp_schedule`` names (``torch.distributed.pipelining``'s)."""

CP_METHODS = ("allgather", "ulysses")
"""How ``cp`` ranks compute attention over the whole sequence (``cp_method``)."""

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
"""The schedules whose two stages per rank are placed in a V: rank ``r`` holds stages ``r``
and ``2 pp - 1 - r``, so that the first and the last stage share a rank."""


@dataclass
class ParallelismConfig:
    """How the ranks split the model: FSDP or HSDP, with or without TP; FSDP with EP; PP
    outermost."""

    # Every data-parallel rank trains on its own slice of each batch (a tp group's ranks share
    # one): the degrees decide where each parameter's shards live. Their product is the world
    # size.
    dp_replicate: int = 1
    """Copies of the sharded model (HSDP's replicas, one per node typically): gradients are
    reduce-scattered within a copy, then all-reduced across copies once per optimizer step.
    1: plain FSDP over all ranks."""
    dp_shard: int = -1
    """Ranks each copy of the model is sharded over (the GPUs of one node typically); -1: the
    world size divided by ``dp_replicate`` (and ``tp``)."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split every projection's heads or hidden units and
    train on the same data (the GPUs of one node typically). ``dp_replicate x dp_shard x tp``
    is the world size. It must divide the heads, key/value heads, FFN hidden size and
    ``training.seq_len`` (sequence parallelism splits the norms' tokens). 1: no tensor
    parallelism."""
    ep: int = 1
    """Expert-parallel degree, carved out of ``dp_shard`` (torchtitan's dp2ep): each group of
    ``ep`` consecutive ranks splits every layer's routed experts (a model with experts:
    ``model.family = "moe"``) and sends each token to its expert's rank and back; the
    experts are FSDP-sharded over the other ``dp_shard / ep`` ranks, the dense parameters over
    all of them. It must divide ``dp_shard`` and the number of experts. 1: no expert
    parallelism."""

    pp: int = 1
    """Pipeline stages' ranks: the model's blocks are cut into ``pp`` consecutive parts (times
    ``pp_stages_per_rank``), the embedding on the first, the final norm and output on the
    last, and each step's microbatches (``training.grad_accum_steps``) flow through them by
    ``pp_schedule``. The outermost dimension: ``pp x dp_replicate x dp_shard x tp`` is the
    world size, and a stage's ranks shard it by the inner ones (the nodes of a cluster,
    typically, each a stage). 1: no pipeline."""
    pp_schedule: str = "1F1B"
    """The pipeline schedule (``torch.distributed.pipelining``): ``GPipe`` (every forward,
    then every backward), ``1F1B`` (one forward one backward: fewer activations held),
    ``Interleaved1F1B`` (several stages per rank: a smaller bubble), ``ZBVZeroBubble`` and
    ``DualPipeV`` (two stages per rank in a V, the input and weight gradients split to fill the
    bubble)."""
    pp_stages_per_rank: int = -1
    """Stages each pipeline rank holds: 1 for GPipe and 1F1B, 2 or more for Interleaved1F1B,
    exactly 2 for ZBVZeroBubble and DualPipeV; -1: the schedule's least (1, or 2)."""

    cp: int = 1
    """Context-parallel degree: ranks that split every sequence (long contexts): each holds
    ``seq_len / cp`` of its tokens, and its activations, and attends over the whole sequence
    by ``cp_method``. The ``cp`` ranks of a group read the same rows; FSDP shards over
    ``dp_shard x cp``. ``training.seq_len`` must divide into ``2 x cp`` chunks (each rank
    holds two, one from each end: causal attention's work balanced). 1: no context
    parallelism."""
    cp_method: str = "allgather"
    """``allgather``: each rank gathers every rank's keys and values and attends its own
    queries over them (Llama 3's); ``ulysses``: an all-to-all gives each rank the whole
    sequence for ``heads / cp`` of the heads (the key/value heads must divide by ``cp``)."""

    def __post_init__(self) -> None:
        check_field(
            self.dp_replicate >= 1, "dp_replicate", f"must be >= 1, got {self.dp_replicate}"
        )
        check_field(
            self.dp_shard == -1 or self.dp_shard >= 1,
            "dp_shard",
            f"must be >= 1, or -1 for the rest of the ranks, got {self.dp_shard}",
        )
        check_field(self.tp >= 1, "tp", f"must be >= 1, got {self.tp}")
        check_field(self.ep >= 1, "ep", f"must be >= 1, got {self.ep}")
        check_field(self.pp >= 1, "pp", f"must be >= 1, got {self.pp}")
        check_field(self.cp >= 1, "cp", f"must be >= 1, got {self.cp}")
        check_field(
            self.cp_method in CP_METHODS,
            "cp_method",
            f"is '{self.cp_method}', not a context-parallel method: choose one of "
            + ", ".join(CP_METHODS),
        )
        names = ", ".join(PIPELINE_SCHEDULES)
        check_field(
            self.pp_schedule in PIPELINE_SCHEDULES,
            "pp_schedule",
            f"is '{self.pp_schedule}', not a pipeline schedule: choose one of {names}",
        )
        check_field(
            self.pp_stages_per_rank == -1 or self.pp_stages_per_rank >= 1,
            "pp_stages_per_rank",
            f"must be >= 1, or -1 for the schedule's least, got {self.pp_stages_per_rank}",
        )
        stages, schedule = self.stages_per_rank, self.pp_schedule
        wanted = {"GPipe": "exactly 1", "1F1B": "exactly 1", "Interleaved1F1B": "2 or more"}
        check_field(
            stages == 1
            if schedule in ("GPipe", "1F1B")
            else stages == 2 or (schedule == "Interleaved1F1B" and stages > 2),
            "pp_stages_per_rank",
            f"is {stages}, but {schedule} holds {wanted.get(schedule, 'exactly 2')} stages per "
            "rank: set it so, or -1 for the schedule's least",
        )

    @property
    def stages_per_rank(self) -> int:
        """``pp_stages_per_rank`` resolved: -1 is 1 for GPipe and 1F1B, else 2."""
        if self.pp_stages_per_rank != -1:
            return self.pp_stages_per_rank
        return 1 if self.pp_schedule in ("GPipe", "1F1B") else 2
