"""The muon plugin in runs: what it trains with what, vetoes, costs, resumes."""

from __future__ import annotations

import warnings

import pytest
import torch

from plugtrain.plugin import local_tensor
from plugtrain.testing import (
    InjectInf,
    StepWatcher,
    Trainer,
    assert_costs,
    count_costs,
    interrupted_and_resumed,
    make_trainer,
)

MUON = ("--plugins.enabled", "muon")


FP16 = ("--training.mixed_precision_param", "float16", "--grad_clip.max_norm", "0.5")
INF_STEP = 2


def fp16_run(dump_folder, enabled: str) -> tuple[Trainer, StepWatcher]:
    """3 fp16 steps with ``enabled`` registered in that order and an inf in the gradients at
    step ``INF_STEP`` (the scaler vetoes it on the device); the trainer, and what changed."""
    watcher = StepWatcher()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "training.mixed_precision_param is float16")
        trainer = make_trainer(
            dump_folder, "--plugins.enabled", enabled, *FP16, "--optimizer.no_decay", '["norm"]',
            steps=3, plugins=[*((name, None) for name in enabled.split(",")),
                              ("inject", InjectInf({INF_STEP})), ("watch", watcher)],
        )  # fmt: skip
    assert list(trainer.host.names())[:3] == enabled.split(",")
    watcher.trainer = trainer
    return trainer, watcher


def test_matrices_train_with_muon_the_rest_with_adamw_and_an_inf_step_changes_nothing(tmp_path):
    """With grad_scaler and grad_clip in either order: the same groups, the vetoed step changes
    no parameter and no state of either optimizer, and both orders give the same bits."""
    runs = [fp16_run(tmp_path / order, order) for order in
            ("muon,grad_scaler,grad_clip", "muon,grad_clip,grad_scaler")]  # fmt: skip
    trainer = runs[0][0]
    muon, decayed, exempt = trainer.optimizer.param_groups
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert muon["muon"] and len(muon["params"]) == 14  # 7 matrices a block, 2 blocks
    assert all(p.ndim == 2 and "layers." in names[id(p)] for p in muon["params"])
    assert {names[id(p)] for p in decayed["params"]} == {"tok_embeddings.weight", "output.weight"}
    assert all("norm" in names[id(p)] for p in exempt["params"]) and exempt["weight_decay"] == 0
    for run, watcher in runs:
        run.run()
        assert int(run.host.get("grad_scaler").skipped_steps) == 1
        # The state: the Muon momentum buffers, the AdamW moments and steps.
        assert watcher.changed == watcher.state_changed == {1: True, 2: False, 3: True}
        assert watcher.lr_steps == {1: 1, 2: 1, 3: 2}
    # The schedule drives every group: after warmup (1 step) each is at its peak x factor.
    lrs = [g["lr"] for g in trainer.optimizer.param_groups]
    assert lrs[0] / 0.02 == pytest.approx(lrs[1] / 3e-3) and lrs[2] == lrs[1]
    (first, _), (second, _) = runs
    pairs = zip(first.model.named_parameters(), second.model.parameters(), strict=True)
    for (name, a), b in pairs:
        assert torch.equal(local_tensor(a), local_tensor(b)), name
        state_a, state_b = first.optimizer.state[a], second.optimizer.state[b]
        assert state_a.keys() == state_b.keys()
        assert all(torch.equal(local_tensor(state_a[k]), local_tensor(state_b[k])) for k in state_a)


@pytest.mark.slow
def test_a_step_vetoed_on_the_device_costs_no_host_sync(tmp_path):
    # grad_clip answers pre_step with a device flag every step: the optimizer takes it as
    # found_inf at every step, read by no one.
    costs = count_costs(tmp_path, "--plugins.enabled", "muon,grad_clip", short=2, long=4)
    assert_costs(costs, syncs=0)


@pytest.mark.slow
def test_resumes_bitwise_and_its_checkpoint_needs_it(tmp_path):
    result = interrupted_and_resumed(tmp_path, *MUON, steps=4, stop_after=2)
    assert result["resumed"] == result["straight"]
    losses = [
        [(r["step"], r.get("loss")) for r in result[k]]
        for k in ("straight_metrics", "resumed_metrics")
    ]
    assert losses[0] == losses[1]
    ckpt = ("--checkpoint.enable", "true", "--checkpoint.interval", "4")
    with pytest.raises(Exception, match="holds the state of another optimizer") as error:
        make_trainer(tmp_path / "resumed", *ckpt, steps=5)
    assert "plugins.enabled = ['muon']" in str(error.value) and "\n" not in str(error.value)
