"""The [parallelism] section: how the ranks shard the model: FSDP, HSDP, TP and EP."""

from __future__ import annotations

from dataclasses import dataclass

from plugtrain.errors import check_field


@dataclass
class ParallelismConfig:
    """How the ranks split the model: FSDP or HSDP, with or without TP; FSDP with EP."""

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
