"""``ParallelDims``: each degree, rank and mesh by name, built once, and on every plugin context."""

from __future__ import annotations

import pytest
import torch

from plugtrain.config import ParallelismConfig
from plugtrain.distributed import ParallelDims, init_parallel_dims, parallel_dims
from plugtrain.errors import ConfigError, FieldError
from plugtrain.plugin import ParallelDims as PluginParallelDims
from plugtrain.plugin import data_parallel_group, hookimpl
from plugtrain.testing import make_trainer, run_distributed

NAMES = ("dp_replicate", "dp_shard", "tp")


def test_the_plugin_api_exports_the_one_parallel_dims():
    assert PluginParallelDims is ParallelDims


@pytest.mark.parametrize(
    ("degrees", "world", "resolved"),
    [
        ((1, -1, 1), 4, (1, 4, 1)),  # FSDP over every rank
        ((2, -1, 1), 4, (2, 2, 1)),  # HSDP
        ((1, -1, 2), 4, (1, 2, 2)),  # TP 2 x FSDP 2
        ((2, 2, 2), 8, (2, 2, 2)),  # HSDP x TP
        ((1, -1, 1), 1, (1, 1, 1)),  # one process
    ],
)
def test_every_rank_has_the_coordinates_of_the_row_major_mesh(degrees, world, resolved):
    # The reference: init_device_mesh lays arange(world) out row-major over the shape.
    layout = torch.arange(world).reshape(resolved)
    for rank in range(world):
        dims = parallel_dims(ParallelismConfig(*degrees), world, rank=rank)
        assert (dims.dp_replicate, dims.dp_shard, dims.tp) == resolved
        assert dims.world_size == world and dims.is_main == (rank == 0)
        coordinates = [int(c) for c in torch.nonzero(layout == rank)[0]]
        assert [dims.rank_in(name) for name in NAMES] == coordinates
        assert [dims.size(name) for name in NAMES] == list(resolved)
        assert [dims.rank_in(n) for n in ("pp", "ep", "cp")] == [0, 0, 0]
        assert dims.tp_enabled == (resolved[2] > 1)
        assert not (dims.pp_enabled or dims.ep_enabled or dims.cp_enabled)


def test_the_data_parallel_ranks_leave_tensor_parallelism_out():
    # 8 ranks, 2 replicas x 2 shards x tp 2: a tp group (consecutive ranks) reads one batch.
    ranks = [parallel_dims(ParallelismConfig(2, 2, 2), 8, rank=r) for r in range(8)]
    assert [d.dp_rank for d in ranks] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert {d.dp_size for d in ranks} == {4} and ranks[0].size("dp") == 4
    hsdp = [parallel_dims(ParallelismConfig(dp_replicate=2), 4, rank=r) for r in range(4)]
    assert [d.dp_rank for d in hsdp] == [0, 1, 2, 3] and hsdp[0].dp_size == 4
    assert [d.rank_in("dp_replicate") for d in hsdp] == [0, 0, 1, 1]


def test_expert_parallelism_is_carved_out_of_dp_shard():
    # ep 2 inside dp_shard 4: the innermost two of each dp_shard group, no extra ranks.
    dims = [ParallelDims(dp_shard=4, ep=2, tp=2, rank=r) for r in range(8)]
    assert dims[0].world_size == 8
    assert [d.rank_in("ep") for d in dims] == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(ConfigError) as refused:
        ParallelDims(dp_shard=4, ep=3)
    assert str(refused.value) == (
        "parallelism.ep = 3 does not divide dp_shard = 4 (expert parallelism is carved out of "
        "dp_shard): choose an ep that divides 4"
    )


@pytest.mark.parametrize(
    ("degrees", "world", "shape"),
    [
        ({"pp": 2}, 2, (2, 1, 1, 1)),  # two stages, one rank each
        ({"pp": 2}, 4, (2, 1, 2, 1)),  # PP 2 x FSDP 2
        ({"pp": 2, "tp": 2}, 8, (2, 1, 2, 2)),  # PP 2 x FSDP 2 x TP 2
        ({"pp": 2, "dp_replicate": 2}, 8, (2, 2, 2, 1)),  # PP 2 x HSDP 2 x 2
    ],
)
def test_pipeline_stages_are_the_outermost_dimension(degrees, world, shape):
    # Row-major over pp x dp_replicate x dp_shard x tp: a stage's ranks are consecutive, and
    # the ranks of one line of stages (same data-parallel and tp place) read the same batches.
    layout = torch.arange(world).reshape(shape)
    for rank in range(world):
        dims = parallel_dims(ParallelismConfig(**degrees), world, rank=rank)
        assert (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp) == shape
        coordinates = [int(c) for c in torch.nonzero(layout == rank)[0]]
        assert [dims.rank_in(n) for n in ("pp", *NAMES)] == coordinates
        assert dims.dp_size == shape[1] * shape[2] and dims.pp_enabled
        assert dims.dp_rank == coordinates[1] * shape[2] + coordinates[2]


def test_pipeline_degrees_that_do_not_fit_are_refused_in_one_line():
    with pytest.raises(ConfigError) as refused:
        parallel_dims(ParallelismConfig(pp=3), 4)
    assert str(refused.value) == (
        "parallelism.pp = 3 does not divide the world size 4: launch a multiple of 3 "
        "processes, or set pp to a divisor of 4"
    )
    with pytest.raises(ConfigError) as refused:
        parallel_dims(ParallelismConfig(pp=2, ep=2), 4)
    assert str(refused.value) == (
        "parallelism.ep = 2 with pp = 2: expert parallelism does not compose with pp yet; set "
        "parallelism.pp = 1, or ep = 1"
    )


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"pp_schedule": "1f1b"},
            "pp_schedule is '1f1b', not a pipeline schedule: choose one of GPipe, 1F1B, "
            "Interleaved1F1B, ZBVZeroBubble, DualPipeV",
        ),
        (
            {"pp_schedule": "ZBVZeroBubble", "pp_stages_per_rank": 3},
            "pp_stages_per_rank is 3, but ZBVZeroBubble holds exactly 2 stages per rank: set it "
            "so, or -1 for the schedule's least",
        ),
        (
            {"pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": 1},
            "pp_stages_per_rank is 1, but Interleaved1F1B holds 2 or more stages per rank: set "
            "it so, or -1 for the schedule's least",
        ),
        ({"pp": 0}, "pp must be >= 1, got 0"),
    ],
)
def test_pipeline_settings_are_checked_in_one_line(keys, message):
    with pytest.raises(FieldError) as refused:
        ParallelismConfig(**keys)
    assert f"{refused.value.key} {refused.value.message}" == message


@pytest.mark.parametrize(
    ("schedule", "stages"),
    [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2)],
)
def test_each_schedule_has_its_least_stages_per_rank(schedule, stages):
    assert ParallelismConfig(pp_schedule=schedule).stages_per_rank == stages


def test_the_builder_keeps_the_mesh_shapes_errors():
    with pytest.raises(ConfigError) as refused:
        parallel_dims(ParallelismConfig(tp=3), 4)
    assert str(refused.value).startswith("parallelism.tp = 3 does not divide the world size 4")
    assert "\n" not in str(refused.value)


def test_an_unknown_dimension_and_a_meshless_one_are_refused_in_one_line():
    dims = ParallelDims()
    with pytest.raises(ValueError, match=r"^no parallel dimension 'fsdp': choose one of dp, "):
        dims.rank_in("fsdp")
    with pytest.raises(ValueError) as refused:
        dims.get_mesh("dp")
    assert str(refused.value) == (
        "no 'dp' mesh: these ParallelDims were built without a process group (a unit-test "
        "context); use a real run (plugtrain.testing.tiny_run)"
    )


class Recorder:
    """Keeps the ParallelDims each context of a run carries."""

    def __init__(self) -> None:
        self.seen: dict[str, ParallelDims] = {}

    @hookimpl
    def wrap_model(self, ctx):
        self.seen["model"] = ctx.parallel_dims

    @hookimpl
    def build_optimizer(self, ctx):
        self.seen["optimizer"] = ctx.parallel_dims

    @hookimpl
    def setup(self, ctx):
        self.seen["setup"] = ctx.parallel_dims


def test_every_plugin_context_carries_the_runs_one_parallel_dims(tmp_path):
    recorder = Recorder()
    trainer = make_trainer(tmp_path / "run", plugins=[("recorder", recorder)])
    dims = trainer.parallel_dims
    assert recorder.seen == {"model": dims, "optimizer": dims, "setup": dims}
    assert all(seen is dims for seen in recorder.seen.values())
    assert (dims.world_size, dims.dp_size, dims.tp, dims.rank) == (1, 1, 1, 0)
    assert dims.get_mesh("dp").mesh_dim_names == ("dp_shard",)
    assert dims.get_mesh("dp_shard") is dims.get_mesh("dp")
    with pytest.raises(ValueError) as refused:
        dims.get_mesh("tp")
    assert str(refused.value) == (
        "the 'tp' mesh dimension is disabled in this run (its degree is 1); this run's mesh "
        "has ('dp_shard',)"
    )


def meshes_on_a_rank() -> dict[str, object]:
    dims = init_parallel_dims("cpu", ParallelismConfig(dp_replicate=2, tp=2))
    group = data_parallel_group(dims)
    return {
        "names": dims.get_mesh("dp").mesh_dim_names,
        "dp": (group.rank(), group.size(), dims.dp_rank, dims.dp_size),
        "mesh_ranks": [dims.get_mesh(name).get_local_rank() for name in NAMES],
        "ranks": [dims.rank_in(name) for name in NAMES],
        "tp_group": dims.get_mesh("tp").mesh.tolist(),
    }


@pytest.mark.slow
def test_on_four_processes_the_meshes_agree_with_the_ranks_by_name():
    # HSDP 2 x TP 2 on 4 ranks: dp_shard is 1, every dimension is sliced from the one mesh.
    results = run_distributed(meshes_on_a_rank, 4)
    for rank, result in enumerate(results):
        assert result["names"] == ("dp_replicate", "dp_shard")
        assert result["mesh_ranks"] == result["ranks"] == [rank // 2, 0, rank % 2]
        assert result["dp"] == (rank // 2, 2, rank // 2, 2)
        assert result["tp_group"] == [rank - rank % 2, rank - rank % 2 + 1]
