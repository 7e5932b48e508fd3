"""Tensor parallelism and what runs beside the training step: the collectives of a TP 2 step
against an FSDP 2 one, counted with the cost counter.

The multi-process checks share one 2-process launch through a module-scoped fixture.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plugtrain.model import FLAVORS
from plugtrain.testing import Costs, count_costs, run_distributed

FP32 = ("--training.mixed_precision_param", "float32")
TP2 = ("--parallelism.tp", "2")
LAYERS = FLAVORS["tiny"].n_layers  # 2
NORMS = 2 * LAYERS + 1  # attention_norm and ffn_norm in each block, and the final norm

# Per non-logging step on 2 processes, from the tiny model's shapes; every case also makes the
# stop vote, one asynchronous all-reduce on a gloo group ("c10d.allreduce_").
COLLECTIVES = {
    "fsdp2": {
        # Forward gathers the root (embedding, final norm, output) and each block; backward
        # gathers again every block but the last, which stays gathered after forward.
        "c10d._allgather_base_": (LAYERS + 1) + (LAYERS - 1),
        # Each FSDP unit's gradients: one reduce-scatter per block and one for the root.
        "c10d._reduce_scatter_base_": LAYERS + 1,
        "c10d.allreduce_": 1,
    },
    "tp2": {
        # Sequence parallelism: in each block the positions are gathered before the attention
        # and before the FFN, and the row-wise wo and w2 reduce-scatter their sums by position:
        # 2 of each in forward, and each one's transpose in backward; the embedding's
        # reduce-scatter and the output projection's gather add one of each, with backward's.
        "_c10d_functional.all_gather_into_tensor": 4 * LAYERS + 2,
        "_c10d_functional.reduce_scatter_tensor": 4 * LAYERS + 2,
        # loss_parallel's cross-entropy of the vocabulary-sharded logits (the max, the sum of
        # the exponentials, the target's logit), and the gradient of each TP-replicated norm
        # weight, partial over the positions each rank normalised.
        "_c10d_functional.all_reduce": 3 + NORMS,
        "c10d.allreduce_": 1,
    },
}
LAYOUTS = {"fsdp2": FP32, "tp2": (*FP32, *TP2)}


def on_each_rank(base: str) -> dict:
    """On each of 2 ranks: the costs per non-logging step of FSDP 2 and of TP 2."""
    root = Path(base)
    return {
        "costs": {
            name: count_costs(root / name, *args, short=2, long=3) for name, args in LAYOUTS.items()
        },
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_distributed(on_each_rank, 2, str(tmp_path_factory.mktemp("tp_plugins")))


@pytest.mark.slow
@pytest.mark.parametrize("layout", COLLECTIVES)
def test_the_collectives_of_a_step_are_those_the_layout_makes(ranks, layout):
    for rank, result in enumerate(ranks):
        costs: Costs = result["costs"][layout]
        assert costs.syncs == 0, (rank, costs.sync_sites)
        assert costs.collectives == COLLECTIVES[layout], (rank, costs.collectives)
