"""The moe family's load balancing: the aux and z losses against their formulas written out,
the bias update moving the load toward balance with no host read, its checkpoint."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from plugtrain.cli import main
from plugtrain.commands.generate import load
from plugtrain.model.moe import FLAVORS, MoE
from plugtrain.model.moe.balance import Balance, load_balancing_loss, update_bias
from plugtrain.model.moe.transformer import moe_layers
from plugtrain.plugin import hookimpl
from plugtrain.testing import count_costs, make_trainer, read_metrics, tiny_run

DEBUG = FLAVORS["debug_moe"]
WEIGHTS = ("--model.moe_aux_loss_weight", "0.01", "--model.moe_z_loss_weight", "0.001")


def written_out(moe: MoE) -> tuple[float, float]:
    """The aux loss and the z-loss of ``moe``'s last forward, from its logits alone, by loops:
    ``E * sum_e f_e * P_e`` (``f_e`` the share of the top-k picks that went to ``e``, ``P_e``
    the mean probability of ``e``) and the mean of ``logsumexp(logits) ** 2``."""
    logits = moe.stats.logits.detach().double()
    tokens, experts = logits.shape
    picks = [0] * experts
    mean_prob = [0.0] * experts
    z = 0.0
    for row in logits.tolist():
        top = max(row)
        total = sum(math.exp(v - top) for v in row)
        probs = [math.exp(v - top) / total for v in row]
        biased = [p + b for p, b in zip(probs, moe.router.expert_bias.tolist(), strict=True)]
        for e in sorted(range(experts), key=lambda e: -biased[e])[: moe.top_k]:
            picks[e] += 1
        for e in range(experts):
            mean_prob[e] += probs[e] / tokens
        z += (top + math.log(total)) ** 2 / tokens
    aux = experts * sum(picks[e] / (tokens * moe.top_k) * mean_prob[e] for e in range(experts))
    return aux, z


def test_the_logged_losses_are_their_formulas_over_the_blocks(tmp_path):
    trainer = make_trainer(
        tmp_path, "--model.family", "moe", "--model.flavor", "debug_moe", *WEIGHTS, steps=1
    )
    balance = trainer.runner.balance
    trainer.train()
    record = read_metrics(tmp_path)[0]
    aux, z = zip(*(written_out(m) for m in balance.layers), strict=True)
    assert record["moe/aux_loss"] == pytest.approx(0.01 * sum(aux) / len(aux), rel=1e-6)
    assert record["moe/router_z_loss"] == pytest.approx(0.001 * sum(z) / len(z), rel=1e-6)
    assert min(aux) > 1  # top-2 routing of an untrained router is not balanced


def test_each_microbatch_adds_its_share_and_the_router_learns_from_it(tmp_path):
    runs = {}
    for accum in (1, 2):
        folder = tmp_path / str(accum)
        args = ("--model.family", "moe", "--model.flavor", "debug_moe", *WEIGHTS)
        trainer = make_trainer(folder, *args, "--training.grad_accum_steps", str(accum))
        trainer.train_step(trainer.batches.next_batch())
        runs[accum] = trainer.runner.loss_terms.sums["moe/aux_loss"]
    # Two halves of the batch, each half the weight: about the whole batch's value.
    assert runs[2] == pytest.approx(runs[1].item(), rel=0.2)
    torch.manual_seed(0)
    moe = MoE(dim=16, num_experts=8, top_k=2, hidden=16)
    moe(torch.randn(10, 16))
    terms = Balance({0: moe}, aux_loss_weight=0.5).terms(
        SimpleNamespace(num_microbatches=2, router=[moe.stats])
    )
    assert terms.keys() == {"aux_loss"}
    assert terms["aux_loss"] == 0.5 / 2 * load_balancing_loss(moe.stats)
    terms["aux_loss"].backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0 and moe.experts.w1.grad is None


def test_the_bias_moves_the_load_toward_balance():
    torch.manual_seed(0)
    moe = MoE(dim=16, num_experts=8, top_k=2, hidden=16)
    with torch.no_grad():
        moe.router.gate.weight[0] += 0.1  # expert 0 wins most tokens (positive inputs)
    x = torch.randn(256, 16).abs()
    balance = Balance({0: moe}, bias_update_rate=0.005)
    imbalance = []
    for _ in range(200):
        moe(x)
        balance.after_backward()
        balance.step()
        load = balance.load.float()
        imbalance.append((load.max() / load.mean()).item())
    assert imbalance[0] > 3.5 and max(imbalance[-20:]) < 1.2
    assert moe.router.expert_bias[0] < 0 < moe.router.expert_bias[1:].max()


def test_the_update_is_a_sign_step_toward_the_mean():
    bias = torch.zeros(4)
    update_bias(bias, torch.tensor([10, 2, 6, 6]), 0.5)
    assert bias.tolist() == [-0.5, 0.5, 0.0, 0.0]


def test_the_balanced_step_reads_nothing_on_the_host(tmp_path):
    args = ("--model.family", "moe", "--model.flavor", "debug_moe", *WEIGHTS)
    costs = count_costs(str(tmp_path), *args, "--model.moe_bias_update_rate", "0.01")
    assert costs.syncs == 0, costs.sync_sites


def test_the_bias_is_checkpointed_and_resumed(tmp_path):
    args = (
        "--model.family", "moe", "--model.flavor", "debug_moe",
        "--model.moe_bias_update_rate", "0.01", "--checkpoint.enable", "true",
        "--checkpoint.interval", "2",
    )  # fmt: skip
    trainer = make_trainer(tmp_path, *args, steps=2)
    trainer.run()
    saved = trainer.runner.balance.state_dict()["expert_bias"]
    assert saved.abs().sum() > 0
    resumed = make_trainer(tmp_path, *args, steps=3)
    assert torch.equal(resumed.runner.balance.state_dict()["expert_bias"], saved)
    resumed.close()


@pytest.mark.parametrize("rate", ["0.01", "0"])
def test_generate_keeps_the_bias_and_export_hf_says_it_leaves_it_out(tmp_path, capsys, rate):
    args = ("--model.family", "moe", "--model.flavor", "debug_moe")
    run = tmp_path / "run"
    trainer = make_trainer(
        run, *args, "--model.moe_bias_update_rate", rate, "--checkpoint.save_final", "true",
        steps=2,
    )  # fmt: skip
    trainer.run()
    bias = trainer.runner.balance.state_dict()["expert_bias"]
    largest = bias.abs().max().item()
    model, _ = load(run)  # generate and eval route as the run did: with its bias
    assert torch.equal(torch.stack([m.router.expert_bias for m in moe_layers(model)]), bias)
    capsys.readouterr()
    assert main(["export-hf", str(run), "-o", str(tmp_path / "hf")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("wrote ")  # the export is still a usable model
    if rate == "0":
        assert largest == 0 and err == ""
        return
    assert largest == pytest.approx(0.02)  # two steps of 0.01
    assert err.splitlines() == [
        f"export-hf: warning: the checkpoint's expert selection bias (moe.expert_bias, max "
        f"|bias| {largest:.4g}) has no place in the Hugging Face format and is left out: the "
        "exported router picks experts without it, not as the trained model did (transformers' "
        "logits differ)"
    ]


class VetoStep:
    """Vetoes step ``step``: with a reason (known on the host: no ``optimizer.step()``) or a
    device flag (the fused optimizer's ``found_inf``), as grad_scaler, grad_clip and
    spike_guard do."""

    def __init__(self, step: int, reason: bool) -> None:
        self.step, self.reason = step, reason

    @hookimpl
    def pre_step(self, ctx):
        if self.reason:
            return "vetoed" if ctx.step == self.step else None
        return torch.tensor(ctx.step == self.step)


@pytest.mark.parametrize("reason", [False, True], ids=["device_flag", "reason"])
def test_a_vetoed_step_leaves_the_bias_as_it_was(tmp_path, reason):
    args = ("--model.family", "moe", "--model.flavor", "debug_moe")
    rate = ("--model.moe_bias_update_rate", "0.01")
    trainer = make_trainer(tmp_path, *args, *rate, plugins=[("veto", VetoStep(2, reason))])
    biases = [trainer.runner.balance.state_dict()["expert_bias"].clone()]
    for _ in range(3):
        trainer.train_step(trainer.batches.next_batch())
        biases.append(trainer.runner.balance.state_dict()["expert_bias"].clone())
    assert int(trainer.vetoes.total) == 1
    bits = [b.view(torch.int32) for b in biases]
    assert not torch.equal(bits[1], bits[0])  # step 1 moved it
    assert torch.equal(bits[2], bits[1])  # step 2, vetoed, never happened
    assert not torch.equal(bits[3], bits[2])


@pytest.mark.slow
def test_two_processes_balance_as_one(tmp_path):
    """FSDP over 2 processes (each expert stack sharded by expert) gives the 1-process run's
    losses, aux losses and loads, the bias moved by the loads summed over both ranks."""
    args = (
        "--model.family", "moe", "--model.flavor", "debug_moe", *WEIGHTS,
        "--model.moe_bias_update_rate", "0.01", "--metrics.moe_tokens_per_expert", "true",
    )  # fmt: skip
    one = tiny_run(tmp_path / "one", *args, steps=5)
    two = tiny_run(tmp_path / "two", *args, steps=5, world_size=2)
    assert two.losses == pytest.approx(one.losses, rel=1e-5)
    for a, b in zip(one.metrics, two.metrics, strict=True):
        assert b["moe/aux_loss"] == pytest.approx(a["moe/aux_loss"], rel=1e-5)
        loads = [k for k in a if k.startswith("moe/tokens_per_expert.")]
        assert len(loads) == 16 and [b[k] for k in loads] == [a[k] for k in loads]
