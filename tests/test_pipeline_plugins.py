"""The plugins under pipeline parallelism (``[parallelism] pp``): the norm and the inf flag
reduced over the stages, and the plugins that refuse a pipeline in one line.

Each rank holds its stage's share of a stand-in model's gradients (the first half of the
tensors on stage 0, the rest on stage 1), plain at PP 2 and FSDP2 DTensors over the stage's
``dp`` mesh at PP 2 x FSDP 2; every value must be the one process's over all of them. The
multi-process checks share one launch per layout: they cost the most time on a 2-core machine.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.distributed as dist
from plugtrain_downstream_eval import DownstreamEval
from plugtrain_grad_clip import GradClip
from plugtrain_grad_scaler import GradScaler
from plugtrain_samples import Samples
from plugtrain_spike_guard import _VALUES, SpikeGuard
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from plugtrain.config import ParallelismConfig
from plugtrain.distributed import ParallelDims, _device_mesh, parallel_dims
from plugtrain.plugin import ConfigError, full_tensor, local_tensor, total_norm
from plugtrain.testing import run_distributed, setup_context, step_context

SHAPES = [(6, 4), (5,), (4, 4), (3, 2)]
"""The stand-in's parameters: stage 0 holds the first two, stage 1 the last two (uneven
shards under FSDP 2)."""
NORMS = (2.0, 1.5, math.inf)
MAX_NORM = 0.5
LOSSES = (2.0, 3.0)
"""The last stage's loss of two steps on data-parallel rank 0 (rank ``d`` adds ``d``)."""


def whole(kind: int) -> list[torch.Tensor]:
    """The whole model's weights (``kind`` 0) or gradients (1), as one process holds them."""
    generator = torch.Generator().manual_seed(kind)
    return [torch.randn(shape, generator=generator) * (i + 1) for i, shape in enumerate(SHAPES)]


def pipeline_dims(world: int) -> ParallelDims:
    """PP 2 on ``world`` ranks (FSDP over the rest), with its mesh: what a run's dims will be
    once ``init_parallel_dims`` lifts its refusal of pp."""
    dist.init_process_group("gloo")
    dims = parallel_dims(ParallelismConfig(pp=2), world, rank=dist.get_rank())
    return dataclasses.replace(dims, root=_device_mesh(dims, "cpu"))


def stage_model(dims: ParallelDims, grads: bool = True) -> nn.ParameterList:
    """This rank's stage of the stand-in, its gradients set (``grads``), sharded over ``dp``."""
    stage = dims.rank_in("pp")

    def placed(t: torch.Tensor) -> torch.Tensor:
        if dims.dp_shard == 1:
            return t.clone()
        return distribute_tensor(t, dims.get_mesh("dp"), [Shard(0)])

    params = []
    for weight, grad in list(zip(whole(0), whole(1), strict=True))[2 * stage : 2 * stage + 2]:
        param = nn.Parameter(placed(weight))
        param.grad = placed(grad) if grads else None
        params.append(param)
    return nn.ParameterList(params)


def poison(model: nn.ParameterList, stage: int, dims: ParallelDims, value: float) -> None:
    """Put ``value`` into one gradient element on data-parallel rank 0 of ``stage`` only."""
    if dims.rank_in("pp") == stage and dims.dp_rank == 0:
        local_tensor(model[0].grad).view(-1)[0] = value


def on_ranks(world: int) -> dict:
    """On each rank: the norms, grad_clip's clipping, grad_scaler's flag and spike_guard's
    values at PP 2 on ``world`` ranks."""
    dims = pipeline_dims(world)
    last = dims.rank_in("pp") == 1
    clip, scaler, guard = GradClip(), GradScaler(), SpikeGuard()
    plugins = {"grad_clip": clip, "grad_scaler": scaler, "spike_guard": guard}
    ctx = setup_context(
        plugins, "--plugins.enabled", ",".join(plugins), "--grad_clip.max_norm", str(MAX_NORM),
        "--spike_guard.max_consecutive", "0", param_dtype=torch.float16, parallel_dims=dims,
    )  # fmt: skip
    for plugin in plugins.values():
        plugin.setup(ctx=ctx)
    grads = [p.grad for p in stage_model(dims)]
    out: dict = {"stage": dims.rank_in("pp")}
    out["norm"] = {p: total_norm(grads, p, dims=dims).item() for p in NORMS}
    # A stage without gradients (all frozen) still joins: the norm is the other stage's.
    out["frozen_stage"] = total_norm(grads if last else [], dims=dims).item()
    model = stage_model(dims)
    poison(model, 1, dims, math.inf)
    out["inf"] = [total_norm([p.grad for p in model], p, dims=dims).item() for p in NORMS]
    # A nan beside an inf on the other stage, on either (a max reduction may drop a nan).
    out["nan"] = []
    for nan_stage in (0, 1):
        model = stage_model(dims)
        poison(model, 1 - nan_stage, dims, math.inf)
        poison(model, nan_stage, dims, math.nan)
        grads = [p.grad for p in model]
        out["nan"] += [total_norm(grads, p, dims=dims).item() for p in NORMS]

    model = stage_model(dims)
    clip.post_backward(ctx=step_context(model))
    out["clip_norm"] = clip.total_norm.item()
    out["clipped"] = [full_tensor(p.grad) for p in model]

    flags = []
    for stage, value in ((None, 0.0), (0, math.inf), (1, math.nan)):
        model = stage_model(dims)
        if stage is not None:
            poison(model, stage, dims, value)
        scaler.unscale_gradients(ctx=step_context(model))
        flags.append(scaler.found_inf.item())
    # An inf on the last stage while the first has no gradient at all.
    model = stage_model(dims, grads=last)
    poison(model, 1, dims, math.inf)
    scaler.unscale_gradients(ctx=step_context(model))
    out["found_inf"] = [*flags, scaler.found_inf.item()]

    values = []
    for loss in LOSSES:  # two steps: the loss of the second is not the first's plus it
        step = step_context(stage_model(dims), loss=torch.tensor(loss + dims.dp_rank))
        if last:  # pre_backward fires on the last stage only
            wrapper = guard.pre_backward(ctx=step)
            next(wrapper)
            with pytest.raises(StopIteration):
                wrapper.send(None)
        guard.observe_gradients(ctx=step)
        values.append(guard._record[_VALUES].tolist())  # the step's tested (loss, grad_norm)
    out["spike_guard"] = values
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["pp2", "pp2xfsdp2"])
def results(request) -> list[dict]:
    return run_distributed(on_ranks, request.param, request.param)


@pytest.mark.slow
def test_the_norm_is_one_processs_on_every_rank(results) -> None:
    grads = whole(1)
    for p in NORMS:
        expected = torch.nn.utils.get_total_norm(grads, p).item()
        assert {r["norm"][p] for r in results} == {results[0]["norm"][p]}  # bitwise equal
        assert results[0]["norm"][p] == pytest.approx(expected, rel=1e-6, abs=0)
    frozen = torch.nn.utils.get_total_norm(grads[2:]).item()
    assert [r["frozen_stage"] for r in results] == pytest.approx([frozen] * len(results), rel=1e-6)


@pytest.mark.slow
def test_an_inf_or_nan_on_one_stage_reaches_every_rank(results) -> None:
    assert all(r["inf"] == [math.inf] * len(NORMS) for r in results)
    assert all(math.isnan(norm) for r in results for norm in r["nan"])


@pytest.mark.slow
def test_grad_clip_clips_each_stage_by_the_whole_models_norm(results) -> None:
    reference = [nn.Parameter(w) for w in whole(0)]
    for param, grad in zip(reference, whole(1), strict=True):
        param.grad = grad
    norm = torch.nn.utils.clip_grad_norm_(reference, MAX_NORM).item()
    for r in results:
        assert r["clip_norm"] == pytest.approx(norm, rel=1e-6, abs=0)
        mine = reference[2 * r["stage"] : 2 * r["stage"] + 2]
        for clipped, param in zip(r["clipped"], mine, strict=True):
            torch.testing.assert_close(clipped, param.grad, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_grad_scaler_skips_on_every_rank_when_one_stage_overflows(results) -> None:
    # Clean; inf on stage 0; nan on stage 1; inf on stage 1 with stage 0 all frozen.
    assert [r["found_inf"] for r in results] == [[0.0, 1.0, 1.0, 1.0]] * len(results)


@pytest.mark.slow
def test_spike_guard_tests_the_last_stages_loss_and_the_whole_norm_on_every_rank(results):
    dp = len(results) // 2
    norm = torch.nn.utils.get_total_norm(whole(1)).item()
    for r in results:
        for (loss, grad_norm), expected in zip(r["spike_guard"], LOSSES, strict=True):
            assert loss == expected + (dp - 1) / 2  # the mean over the data-parallel ranks
            assert grad_norm == pytest.approx(norm, rel=1e-6, abs=0)


@pytest.mark.parametrize(
    "name, plugin", [("samples", Samples), ("downstream_eval", DownstreamEval)]
)
def test_the_plugins_that_run_the_whole_model_refuse_a_pipeline_in_one_line(name, plugin) -> None:
    plugin = plugin()
    ctx = setup_context(
        {name: plugin}, "--plugins.enabled", name, parallel_dims=ParallelDims(pp=2, rank=1)
    )
    with pytest.raises(ConfigError) as refused:
        plugin.setup(ctx=ctx)
    assert str(refused.value) == (
        f"plugin '{name}' runs the whole model, but under pipeline parallelism "
        f"(parallelism.pp = 2) each rank holds only its stages: remove '{name}' from "
        "plugins.enabled, or set parallelism.pp = 1"
    )
