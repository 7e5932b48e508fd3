"""Tensor parallelism needs no change to the model: a plan by module names, applied with
``parallelize_module`` over 2 gloo processes, gives the unsharded model's logits and
gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from plugtrain.model import FLAVORS, Transformer, cross_entropy
from plugtrain.testing import run_distributed

TINY = FLAVORS["tiny"]  # 4 query heads and 2 key/value heads: 2 and 1 per rank


def tensor_parallel_plan(n_layers: int) -> dict:
    """torchtitan's Llama plan, sequence parallel included, by fully qualified names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(n_layers):
        plan |= {
            f"layers.{i}.attention_norm": SequenceParallel(),
            f"layers.{i}.attention": PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            ),
            f"layers.{i}.attention.wq": ColwiseParallel(),
            f"layers.{i}.attention.wk": ColwiseParallel(),
            f"layers.{i}.attention.wv": ColwiseParallel(),
            f"layers.{i}.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            f"layers.{i}.ffn_norm": SequenceParallel(),
            f"layers.{i}.feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            f"layers.{i}.feed_forward.w1": ColwiseParallel(),
            f"layers.{i}.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            f"layers.{i}.feed_forward.w3": ColwiseParallel(),
        }
    return plan


def _tensor_parallel_against_unsharded() -> tuple[float, float, list[str]]:
    """On each rank: the largest logit and gradient differences between the model under the
    plan and the unsharded one, and the plan's names the model lacks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    reference = Transformer(TINY)
    reference.init_weights(seed=0)
    model = copy.deepcopy(reference)
    plan = tensor_parallel_plan(TINY.n_layers)
    modules = dict(model.named_modules())
    parallelize_module(model, mesh, plan)

    tokens = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    logits, want = model(tokens[:, :-1]), reference(tokens[:, :-1])
    cross_entropy(logits, tokens[:, 1:]).backward()
    cross_entropy(want, tokens[:, 1:]).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    assert len(sharded) == len(grads), sorted(set(grads) - set(sharded))
    grad_diff = max(
        (grads[n].full_tensor() - p.grad).abs().max().item()
        for n, p in reference.named_parameters()
    )
    assert model.layers["0"].attention.wq.weight.to_local().shape[0] == TINY.dim // 2
    return (logits - want).abs().max().item(), grad_diff, [n for n in plan if n not in modules]


@pytest.mark.slow
def test_a_tensor_parallel_plan_by_names_matches_the_unsharded_model() -> None:
    for logit_diff, grad_diff, unknown in run_distributed(_tensor_parallel_against_unsharded, 2):
        assert unknown == []
        assert logit_diff < 1e-5
        assert grad_diff < 1e-5
