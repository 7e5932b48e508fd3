"""FSDP2 on several real processes (gloo on loopback)."""

from __future__ import annotations

import pytest

from plugtrain.testing import (
    StepWatcher,
    make_trainer,
    read_metrics,
    run_distributed,
    run_script,
    tiny_args,
)


def veto_on_every_rank(dump_folder: str) -> dict:
    """Run on each rank: hook_recorder vetoes step 2; what each step did on this rank."""
    watcher = StepWatcher()
    trainer = make_trainer(
        dump_folder,
        "--plugins.enabled",
        "hook_recorder",
        "--hook_recorder.veto_steps",
        "[2]",
        plugins=[("watcher", watcher)],
    )
    watcher.trainer = trainer
    trainer.run()
    return {"changed": watcher.changed, "lr_steps": watcher.lr_steps, "rank": trainer.world.rank}


pytestmark = pytest.mark.slow


def losses(dump_folder) -> list[float]:
    return [r["loss"] for r in read_metrics(dump_folder) if "loss" in r]


def test_two_processes_match_one_process_of_the_same_global_batch(tmp_path, train_py):
    args = ["--training.steps", "6", "--training.batch_size", "8"]
    args += ["--validation.interval", "6", "--validation.steps", "2"]
    one = run_script(train_py, [*tiny_args(tmp_path / "one"), *args])
    assert one.returncode == 0, one.stderr
    two = run_script(train_py, [*tiny_args(tmp_path / "two"), *args], nproc=2)
    assert two.returncode == 0, two.stderr
    l1, l2 = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(l1) == len(l2) == 6
    assert l2 == pytest.approx(l1, rel=1e-5, abs=1e-5)
    assert l1[0] != l1[-1]
    (v1,), (v2,) = ([r for r in read_metrics(tmp_path / n) if "validation_loss" in r]
                    for n in ("one", "two"))  # fmt: skip
    assert set(v1) == set(v2) == {"step", "validation_loss", "validation_bpb"}
    assert v2 == pytest.approx(v1, rel=1e-6)  # the same batches, split over the ranks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_parameter_dtype_trains_on_two_processes(tmp_path, dtype, train_py):
    result = run_script(train_py,
        [*tiny_args(tmp_path, steps=12), "--training.mixed_precision_param", dtype,
         "--training.batch_size", "8", "--optimizer.lr", "0.01"],
        nproc=2,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    trained = losses(tmp_path)
    assert len(trained) == 12
    assert trained[-1] < trained[0] - 0.5, trained


def test_veto_leaves_parameters_and_schedule_unchanged_on_every_rank(tmp_path):
    results = run_distributed(veto_on_every_rank, 2, str(tmp_path))
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["changed"] == {1: True, 2: False, 3: True}, r
        assert r["lr_steps"] == {1: 1, 2: 1, 3: 2}, r
