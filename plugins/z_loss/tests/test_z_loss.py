"""z_loss: its value against the formula by hand, in a run, with a loss scaler, its costs."""

from __future__ import annotations

import pytest
import torch
from plugtrain_z_loss import ZLoss

from plugtrain.plugin import ConfigError, LossContext, hookimpl
from plugtrain.testing import (
    SAMPLE,
    assert_costs,
    check_order_independence,
    count_costs,
    setup_context,
)

NAME = "z_loss"
ENABLED = ("--plugins.enabled", NAME)


def squared_lse(logits: torch.Tensor) -> torch.Tensor:
    """``log(sum(exp(logits)))^2`` of each token, in float64, written out."""
    x = logits.double()
    peak = x.max(dim=-1, keepdim=True).values
    return (peak.squeeze(-1) + x.sub(peak).exp().sum(dim=-1).log()).pow(2)


def by_hand(logits: torch.Tensor, weight: float) -> float:
    """``weight * mean(log(sum(exp(logits)))^2)`` over tokens, in float64."""
    return weight * squared_lse(logits).mean().item()


@pytest.mark.parametrize("bad", ["0", "-1", "inf"])
def test_a_bad_weight_is_a_one_line_config_error(bad):
    with pytest.raises(ConfigError, match=r"config key 'z_loss\.weight' must be finite and > 0"):
        setup_context({}, *ENABLED, "--z_loss.weight", bad)


def test_the_term_is_the_formula_by_hand():
    plugin = ZLoss()
    plugin.setup(setup_context({NAME: plugin}, *ENABLED, "--z_loss.weight", "0.01"))
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0)) * 30
    targets, every = torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.bool)
    ctx = LossContext(1, 0, 1, logits.requires_grad_(), targets, every, 10.0)
    term = plugin.loss_terms(ctx)["z_loss"]
    assert term.ndim == 0 and term.requires_grad
    assert term.item() == pytest.approx(by_hand(logits.detach(), 0.01), rel=1e-6)
    # A mask leaves targets out, and the step's count (here of two microbatches) divides.
    mask = every.clone()
    mask[0, :3] = False
    ctx = LossContext(1, 0, 2, logits, targets, mask, 16.0)
    expected = 0.01 * squared_lse(logits.detach())[mask].sum().item() / 16
    assert plugin.loss_terms(ctx)["z_loss"].item() == pytest.approx(expected, rel=1e-6)


class Logits:
    """Keeps each microbatch's logits (adding no term), to recompute the z-loss by hand."""

    def __init__(self) -> None:
        self.logits: dict[int, list[torch.Tensor]] = {}

    @hookimpl
    def loss_terms(self, ctx: LossContext) -> None:
        self.logits.setdefault(ctx.step, []).append(ctx.logits.detach().clone())


def test_a_run_logs_the_term_averaged_over_microbatches(plugtrain_run):
    seen = Logits()
    accum = ("--training.grad_accum_steps", "2")
    run = plugtrain_run(*ENABLED, *accum, plugins=[("logits", seen)])
    plain = plugtrain_run(*accum)
    logged = {r["step"]: r["z_loss/z_loss"] for r in run.metrics if "loss" in r}
    for step, microbatches in seen.logits.items():
        expected = sum(by_hand(logits, 1e-4) for logits in microbatches) / len(microbatches)
        assert logged[step] == pytest.approx(expected, rel=1e-5)
    assert run.losses[1] == plain.losses[1]  # the logged loss stays the cross-entropy
    assert run.checksums != plain.checksums  # the term's gradient trains the model


class Masked:
    """Keeps each microbatch's logits and the mask of its counted targets, adding no term."""

    def __init__(self) -> None:
        self.seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @hookimpl
    def loss_terms(self, ctx: LossContext) -> None:
        logits = ctx.logits.detach().clone()
        self.seen.setdefault(ctx.step, []).append((logits, ctx.mask.clone()))


def test_on_chat_data_the_term_is_masked_and_divided_by_the_steps_assistant_targets(
    plugtrain_run,
):
    """As the cross-entropy (and OLMo-core's z-loss): the sum over the assistant's targets of
    both microbatches, over their count in the step, not a mean of microbatch means."""
    seen = Masked()
    chat = ("--data.train_path", str(SAMPLE / "chat_train.jsonl"), "--training.seq_len", "96")
    accum = ("--training.grad_accum_steps", "2", "--z_loss.weight", "0.01")
    run = plugtrain_run(*ENABLED, *chat, *accum, plugins=[("masked", seen)], steps=2)
    logged = {r["step"]: r["z_loss/z_loss"] for r in run.metrics if "loss" in r}
    for step, microbatches in seen.seen.items():
        counts = [int(mask.sum()) for _, mask in microbatches]
        assert len(microbatches) == 2 and counts[0] != counts[1], counts
        assert 0 < sum(counts) < sum(mask.numel() for _, mask in microbatches)
        masked_sum = sum(squared_lse(logits)[mask].sum().item() for logits, mask in microbatches)
        expected = 0.01 * masked_sum / sum(counts)
        assert logged[step] == pytest.approx(expected, rel=1e-4)
        if step == 1:  # the former term, each microbatch's mean over every token, fails it
            means = [by_hand(logits, 0.01) for logits, _ in microbatches]
            assert sum(means) / 2 != pytest.approx(expected, rel=1e-4)


def test_with_the_loss_scaler_in_float16_the_order_does_not_matter(tmp_path):
    fp16 = ("--training.mixed_precision_param", "float16", "--z_loss.weight", "0.01")
    check_order_independence(tmp_path, NAME, *fp16, others=["grad_scaler"], steps=2)


def test_no_host_sync_and_no_collective_per_step(tmp_path):
    costs = count_costs(tmp_path, *ENABLED, plugin=NAME)
    print(f"z_loss: {costs.ms:.3f} ms per step in its hooks")
    assert_costs(costs, syncs=0, collectives={})
