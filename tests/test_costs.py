"""CostCounter: host syncs and collectives, counted exactly, nested, and nothing when off."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _len_torch_dispatch_stack

from plugtrain.config import ParallelismConfig
from plugtrain.distributed import init_parallel_dims
from plugtrain.observability.costs import CostCounter
from plugtrain.plugin import hookimpl, local_tensor
from plugtrain.testing import run_distributed, tiny_args
from plugtrain.training.launch import configure
from plugtrain.training.trainer import Trainer

SCALAR = torch.tensor(2.0)
VECTOR = torch.tensor([1.0, 0.0])

READS = {
    "Tensor.item": lambda: SCALAR.item(),
    "Tensor.tolist": lambda: VECTOR.tolist(),
    "Tensor.numpy": lambda: VECTOR.numpy(),
    "Tensor.__bool__": lambda: bool(SCALAR),
    "Tensor.__float__": lambda: float(SCALAR),
    "Tensor.__int__": lambda: int(SCALAR),
    "Tensor.__index__": lambda: [0, 1, 2][torch.tensor(1)],
    "Tensor.__complex__": lambda: complex(SCALAR),
    "Tensor.__format__": lambda: f"{SCALAR:.1f}",
    "Tensor.__repr__": lambda: repr(VECTOR),
    "Tensor.__contains__": lambda: 1.0 in VECTOR,
    "Tensor.is_nonzero": lambda: SCALAR.is_nonzero(),
    "torch.is_nonzero": lambda: torch.is_nonzero(SCALAR),
    "torch.equal": lambda: torch.equal(VECTOR, VECTOR),
    "Tensor.equal": lambda: VECTOR.equal(VECTOR),
    "torch.allclose": lambda: torch.allclose(VECTOR, VECTOR),
    "Tensor.nonzero": lambda: VECTOR.nonzero(),
    "torch.nonzero": lambda: torch.nonzero(VECTOR),
    "torch.argwhere": lambda: torch.argwhere(VECTOR),
    "Tensor.masked_select": lambda: VECTOR.masked_select(VECTOR > 0),
}


@pytest.mark.parametrize("cause", list(READS))
def test_each_host_read_counts_once_under_its_name(cause):
    with CostCounter() as costs:
        READS[cause]()
    assert costs.syncs == {cause: 1}
    assert costs.num_syncs == 1 and costs.num_collectives == 0
    [site] = costs.sync_sites
    assert site.startswith(f"{cause} at {__name__}:")


def test_work_without_reads_counts_nothing():
    with CostCounter() as costs:
        x = torch.randn(8, 8, requires_grad=True)
        y = (x @ x).relu().sum()
        y.backward()
        SCALAR.cpu()  # already on the host: no copy, no wait
        SCALAR.to("cpu")
        repr(torch.ones(3, device="meta"))  # a meta tensor has no data to read
    assert costs.syncs == {} and costs.collectives == {}


def test_counters_nest_and_reentering_one_counts_once():
    outer, inner = CostCounter(), CostCounter()
    with outer:
        SCALAR.item()
        with inner:
            bool(SCALAR)
            with inner:  # already active: not counted twice
                float(SCALAR)
            with outer:
                float(SCALAR)
        SCALAR.item()
    assert inner.syncs == {"Tensor.__bool__": 1, "Tensor.__float__": 2}
    assert outer.syncs == {"Tensor.item": 2, "Tensor.__bool__": 1, "Tensor.__float__": 2}
    with inner:  # counts accumulate over every time a counter is entered
        SCALAR.item()
    assert inner.num_syncs == 4 and outer.num_syncs == 5


def test_ignore_leaves_out_reads_but_not_collectives():
    init_parallel_dims("cpu", ParallelismConfig())
    with CostCounter() as costs:
        with CostCounter.ignore():
            SCALAR.item()
            dist.all_reduce(torch.ones(1))
        VECTOR.tolist()
    assert costs.syncs == {"Tensor.tolist": 1}
    assert costs.collectives == {"c10d.allreduce_": 1}


def test_nothing_is_installed_unless_a_counter_is_active():
    synchronize = torch.cuda.synchronize
    assert _get_current_function_mode_stack() == [] and _len_torch_dispatch_stack() == 0
    with CostCounter(), CostCounter():
        assert len(_get_current_function_mode_stack()) == 1
        assert _len_torch_dispatch_stack() == 1
        assert torch.cuda.synchronize is not synchronize
    assert _get_current_function_mode_stack() == [] and _len_torch_dispatch_stack() == 0
    assert torch.cuda.synchronize is synchronize


def test_cuda_synchronize_is_counted_even_where_it_fails():
    # This build has no CUDA: the call fails, after the patched function has counted it.
    with CostCounter() as costs, pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.synchronize()
    assert costs.syncs == {"torch.cuda.synchronize": 1}


def test_reads_in_backward_count_when_they_run_an_aten_op():
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: g.sum().item() and None)
    y.register_hook(lambda g: g.tolist() and None)  # runs no aten op: not seen in backward
    with CostCounter() as costs:
        y.sum().backward()
    # torch turns function modes off inside autograd's hooks; the dispatch-level read remains.
    assert costs.syncs == {"aten._local_scalar_dense": 1}


def test_collectives_on_one_process_count_by_op():
    mesh = init_parallel_dims("cpu", ParallelismConfig()).get_mesh("dp")
    with CostCounter() as costs:
        dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(2))
        funcol.all_reduce(torch.ones(2), "sum", mesh).wait()  # wait_tensor: no collective
        dist.barrier()
    assert costs.collectives == {
        "c10d.allreduce_": 2, "_c10d_functional.all_reduce": 1, "c10d.barrier": 1
    }  # fmt: skip
    assert costs.syncs == {}


def test_a_dtensor_read_counts_once():
    mesh = init_parallel_dims("cpu", ParallelismConfig()).get_mesh("dp")
    replicated = DTensor.from_local(torch.tensor([1.0, 2.0]), mesh, [Replicate()])
    with CostCounter() as costs:
        replicated.sum().item()
    assert costs.syncs == {"Tensor.item": 1}


def _partial_plus_one() -> tuple[dict, dict]:
    mesh = init_parallel_dims("cpu", ParallelismConfig()).get_mesh("dp")
    partial = DTensor.from_local(torch.ones(2), mesh, [Partial()])
    with CostCounter() as costs:
        result = partial + 1  # DTensor all-reduces the partial sums inside the op
    assert result.to_local().tolist() == [3.0, 3.0]
    return dict(costs.collectives), dict(costs.syncs)


@pytest.mark.slow
def test_collectives_dtensor_issues_inside_an_op_are_counted():
    assert run_distributed(_partial_plus_one, 2) == [({"_c10d_functional.all_reduce": 1}, {})] * 2


# ---------------------------------------------------------------- whole training steps


class ItemInPreStep:
    """A control: one deliberate host read per step."""

    @hookimpl
    def pre_step(self, ctx):
        local_tensor(ctx.model.tok_embeddings.weight).sum().item()


def step_costs(tmp_path, *args: str, extra: dict | None = None, steps: int = 2) -> list:
    """The CostCounter of each ``Trainer.train_step`` of a tiny run, after the first, and the
    number of parameter tensors."""
    config, host = configure([*tiny_args(tmp_path, steps=steps + 1), *args])
    for name, plugin in (extra or {}).items():
        host.register(plugin, name)
    trainer = Trainer(config, host)
    trainer.model.train()
    trainer.train_step(trainer.batches.next_batch())  # the first step builds optimizer state
    counters = []
    for _ in range(steps):
        batch = trainer.batches.next_batch()
        with CostCounter() as costs:
            trainer.train_step(batch)
        counters.append(costs)
    trainer.close()
    return counters, len(trainer.params)


def test_what_a_one_process_step_costs(tmp_path):
    base, _ = step_costs(tmp_path / "base")
    clip, _ = step_costs(tmp_path / "clip", "--plugins.enabled", "grad_clip")
    control, _ = step_costs(tmp_path / "control", extra={"item": ItemInPreStep()})
    for name, counters in (("no plugins", base), ("grad_clip", clip), ("control", control)):
        print(name, *counters, *counters[-1].sync_sites.items(), sep="\n  ")
    for costs in [*base, *clip]:
        # On one process FSDP2 and DTensor issue no collective; the fused AdamW and grad_clip's
        # device veto read nothing (tests/test_zero_sync.py counts whole runs).
        assert costs.collectives == {} and costs.syncs == {}
    for costs in control:
        assert costs.syncs == Counter({"Tensor.item": 1})
        [site] = costs.sync_sites
        assert site.startswith("Tensor.item at tests.test_costs:") and "(pre_step)" in site
