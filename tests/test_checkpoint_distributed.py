"""Checkpoints on two processes: exact resume, SIGTERM on one rank, resharding 2 -> 1, and
surviving ``kill -9`` of a worker under ``torchrun --max-restarts``."""

from __future__ import annotations

import os
import re
import shutil

import checkpoint_workers as cw
import pytest
from conftest import read_metrics
from distributed import run_distributed
from runs import run_train_py, tiny_args
from test_checkpoint import (  # noqa: F401 (one_thread: a fixture)
    CKPT,
    assert_same_parameters,
    model_tensors,
    one_thread,
    steps_losses,
)

from plugtrain.checkpoint.faults import FAULT_ENV

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """Each scenario's results on both ranks, by (dtype, async_mode)."""
    root = tmp_path_factory.mktemp("two_ranks")
    per_rank = run_distributed(cw.two_rank_scenarios, 2, str(root))
    return {
        scenario: [results[i] for results in per_rank]
        for i, scenario in enumerate(cw.TWO_RANK_SCENARIOS)
    } | {"root": root}


@pytest.mark.parametrize("scenario", cw.TWO_RANK_SCENARIOS, ids="-".join)
def test_two_processes_resume_exactly_after_sigterm_on_one_rank(two_ranks, scenario):
    ranks = two_ranks[scenario]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["stopped_at"] == cw.K and r["step_at_resume"] == cw.K, r["rank"]
        assert r["saved_after_stop"] == ["step-3", f"step-{cw.K}"]
        assert_same_parameters(r["resumed_params"], r["straight_params"])
        assert r["counter_loaded"] == [{"count": cw.K, "total": sum(range(1, cw.K + 1))}]
        assert r["counter_final"] == 2 * cw.K and r["stateless_loaded"] == 0
    main = ranks[0]
    assert steps_losses(main["resumed_records"]) == steps_losses(main["straight_records"])
    assert len(steps_losses(main["resumed_records"])) == 2 * cw.K


def test_a_two_process_checkpoint_resumes_on_one(two_ranks, tmp_path):
    two = two_ranks[("float32", "disabled")][0]
    source = two_ranks["root"] / "float32-disabled" / "resumed" / "checkpoints" / f"step-{cw.K}"
    shutil.copytree(source, tmp_path / "checkpoints" / f"step-{cw.K}")
    trainer = cw.build(tmp_path, *CKPT)
    assert trainer.step == cw.K
    loaded = cw.full_parameters(trainer)
    assert_same_parameters(loaded, model_tensors(source))  # resharded bit for bit
    cw.run(trainer)
    got = read_metrics(tmp_path)
    expected = [r for r in two["straight_records"] if r["step"] > cw.K]
    assert (
        [r["step"] for r in got]
        == [r["step"] for r in expected]
        == list(range(cw.K + 1, 2 * cw.K + 1))
    )
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
    assert [r["lr"] for r in got] == [r["lr"] for r in expected]


def test_torchrun_restarts_after_kill_9_and_finishes_like_an_uninterrupted_run(two_ranks, tmp_path):
    # Two crashes, each once: rank 1 dies while saving step 4 (its shard and DCP's metadata
    # written, the checkpoint not yet committed), then rank 0 dies after step 5.
    markers = tmp_path / "saving-killed", tmp_path / "step-killed"
    faults = f"before_commit:{cw.K}:1:{markers[0]},after_step:{cw.K + 1}:0:{markers[1]}"
    run = tmp_path / "run"
    result = run_train_py(
        [*tiny_args(run, steps=2 * cw.K), *CKPT],
        nproc=2,
        # NOTE: torch 2.13's agent keeps its rendezvous store across restarts, and restarted
        # workers then read the dead ones' gloo addresses from it and hang (pytorch#135712).
        env={FAULT_ENV: faults, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        torchrun_args=("--standalone", "--max-restarts=2"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(m.exists() for m in markers)
    resumed = re.findall(r"resumed from \S+/(step-\d+) ", result.stderr)
    assert resumed == ["step-2", f"step-{cw.K}"]  # the half-saved step 4 was never loaded
    straight = two_ranks[("float32", "disabled")][0]
    assert steps_losses(read_metrics(run)) == steps_losses(straight["straight_records"])
    checkpoints = sorted(os.listdir(run / "checkpoints"))
    assert checkpoints == [f"step-{s}" for s in (cw.K, cw.K + 2, 2 * cw.K)]
    final = run / "checkpoints" / f"step-{2 * cw.K}"
    assert_same_parameters(model_tensors(final), straight["straight_params"])
