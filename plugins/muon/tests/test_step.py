"""The muon plugin in runs: what it trains with what, vetoes, costs, resumes."""

from __future__ import annotations

import pytest
import torch

from plugtrain.plugin import StepContext, hookimpl
from plugtrain.testing import (
    StepWatcher,
    assert_costs,
    count_costs,
    interrupted_and_resumed,
    make_trainer,
)

MUON = ("--plugins.enabled", "muon")


class VetoAt:
    """Vetoes step ``step`` with a device flag (no host read), as spike_guard or a scaler do."""

    def __init__(self, step: int) -> None:
        self.step = step

    @hookimpl
    def pre_step(self, ctx: StepContext) -> torch.Tensor:
        return torch.tensor(ctx.step == self.step)


def test_matrices_train_with_muon_the_rest_with_adamw_and_a_veto_changes_nothing(tmp_path):
    watcher = StepWatcher()
    trainer = make_trainer(
        tmp_path, *MUON, "--optimizer.no_decay", "[\"norm\"]", steps=3,
        plugins=[("veto", VetoAt(2)), ("watch", watcher)],
    )  # fmt: skip
    watcher.trainer = trainer
    muon, decayed, exempt = trainer.optimizer.param_groups
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert muon["muon"] and len(muon["params"]) == 14  # 7 matrices a block, 2 blocks
    assert all(p.ndim == 2 and "layers." in names[id(p)] for p in muon["params"])
    assert {names[id(p)] for p in decayed["params"]} == {"tok_embeddings.weight", "output.weight"}
    assert all("norm" in names[id(p)] for p in exempt["params"]) and exempt["weight_decay"] == 0
    trainer.run()
    assert watcher.changed == {1: True, 2: False, 3: True}
    assert watcher.state_changed == {1: True, 2: False, 3: True}
    assert watcher.lr_steps == {1: 1, 2: 1, 3: 2}
    # The schedule drives every group: after warmup (1 step) each is at its peak x factor.
    lrs = [g["lr"] for g in trainer.optimizer.param_groups]
    assert lrs[0] / 0.02 == pytest.approx(lrs[1] / 3e-3) and lrs[2] == lrs[1]


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
