"""The hook contract, observed through the example hook_recorder plugin and test plugins."""

from __future__ import annotations

import pytest
import torch
from runs import tiny_args

from plugtrain.plugin import StepContext, hookimpl
from plugtrain.training.launch import configure
from plugtrain.training.trainer import Trainer


def make_trainer(tmp_path, *args: str, extra: dict | None = None, steps: int = 3) -> Trainer:
    config, host = configure([*tiny_args(tmp_path / "run", steps=steps), *args])
    for name, plugin in (extra or {}).items():
        host.register(plugin, name)
    return Trainer(config, host)


def expected_calls(steps: int, accum: int, vetoed=()) -> list[tuple]:
    calls = [("setup", 0, 0, False)]
    for step in range(1, steps + 1):
        calls += [("pre_backward", step, m, False) for m in range(accum)]
        calls += [
            ("post_backward", step, accum - 1, False),
            ("pre_step", step, accum - 1, False),
            ("post_step", step, accum - 1, step in vetoed),
            ("step_metrics", step, accum - 1, False),
        ]
    return calls


@pytest.mark.parametrize("accum", [1, 2])
def test_exact_hook_sequence(tmp_path, accum):
    trainer = make_trainer(
        tmp_path, "--plugins.enabled", "hook_recorder", "--training.grad_accum_steps", str(accum)
    )
    trainer.train()
    recorder = trainer.host.get("hook_recorder")
    got = [(c.hook, c.step, c.microbatch, c.skipped) for c in recorder.calls]
    assert got == expected_calls(3, accum)


class ContextProbe:
    """Checks what each hook receives, as the hook specification documents it."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.logged_losses: list[float] = []

    @hookimpl
    def pre_backward(self, ctx: StepContext) -> None:
        assert ctx.loss is not None and ctx.loss.requires_grad and ctx.loss.ndim == 0
        assert ctx.num_microbatches == 2
        assert all(p.grad is None for p in ctx.parameters()) or ctx.microbatch > 0
        ctx.loss = ctx.loss * 0.0  # replacing the loss changes what backward sees...
        self.seen.append("pre_backward")

    @hookimpl
    def post_backward(self, ctx: StepContext) -> None:
        grads = ctx.gradients()
        assert len(grads) == len(list(ctx.parameters()))
        # ...so every gradient is zero, and the step does nothing.
        assert all(torch.count_nonzero(g.full_tensor()) == 0 for g in grads)
        self.seen.append("post_backward")

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        assert ctx.skipped is False and ctx.skip_reasons == []
        self.seen.append("post_step")


def test_step_context_contents_and_loss_replacement(tmp_path):
    probe = ContextProbe()
    trainer = make_trainer(
        tmp_path, "--training.grad_accum_steps", "2", "--optimizer.weight_decay", "0",
        extra={"probe": probe}, steps=2,
    )  # fmt: skip
    before = [p.detach().full_tensor().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert probe.seen == ["pre_backward"] * 2 + ["post_backward", "post_step"] * 1 + [
        "pre_backward"
    ] * 2 + ["post_backward", "post_step"]
    after = [p.detach().full_tensor() for p in trainer.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # The logged loss is the unscaled one, whatever pre_backward did to ctx.loss.
    from conftest import read_metrics

    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert all(loss > 5.0 for loss in losses)


def test_veto_skips_optimizer_and_lr_schedule(tmp_path):
    trainer = make_trainer(
        tmp_path, "--plugins.enabled", "hook_recorder", "--hook_recorder.veto_steps", "[2]"
    )
    params = {}
    lrs = {}

    class Snapshot:
        @hookimpl
        def pre_step(self, ctx):
            params[ctx.step] = [p.detach().full_tensor().clone() for p in ctx.parameters()]
            lrs[ctx.step] = trainer.lr_scheduler.last_epoch

        @hookimpl
        def post_step(self, ctx):
            same = all(
                torch.equal(a, p.detach().full_tensor())
                for a, p in zip(params[ctx.step], ctx.parameters(), strict=True)
            )
            assert same == ctx.skipped, f"step {ctx.step}: parameters changed={not same}"
            assert trainer.lr_scheduler.last_epoch == lrs[ctx.step] + (0 if ctx.skipped else 1)

    trainer.host.register(Snapshot(), "snapshot")
    trainer.train()
    recorder = trainer.host.get("hook_recorder")
    post = [c for c in recorder.calls if c.hook == "post_step"]
    assert [c.skipped for c in post] == [False, True, False]
    assert trainer.lr_scheduler.last_epoch == 2  # 3 steps, one vetoed
    assert trainer.skipped_steps == 1


class ScaleUnscale:
    """A stand-in loss scaler: scales the loss, unscales in the core's "run first" slot."""

    factor = 1024.0

    @hookimpl
    def pre_backward(self, ctx):
        ctx.loss = ctx.loss * self.factor

    @hookimpl(tryfirst=True)
    def post_backward(self, ctx):
        for g in ctx.gradients():
            g.div_(self.factor)


class GradReader:
    def __init__(self):
        self.norms = []

    @hookimpl
    def post_backward(self, ctx):
        norms = [g.full_tensor().norm() for g in ctx.gradients()]
        self.norms.append(torch.stack(norms).norm().item())


@pytest.mark.parametrize("scaler_first", [True, False])
def test_run_first_slot_beats_registration_order(tmp_path, scaler_first):
    plain = GradReader()
    make_trainer(tmp_path / "a", extra={"reader": plain}, steps=2).train()
    reader = GradReader()
    pair = [("scaler", ScaleUnscale()), ("reader", reader)]
    extra = dict(pair if scaler_first else pair[::-1])
    make_trainer(tmp_path / "b", extra=extra, steps=2).train()
    assert reader.norms == pytest.approx(plain.norms, rel=1e-5)


def test_deactivated_plugin_never_fires_again(tmp_path):
    class Inactive:
        fired = 0

        @hookimpl
        def setup(self, ctx):
            ctx.deactivate(self, "nothing to do")

        @hookimpl
        def pre_backward(self, ctx):
            Inactive.fired += 1

    trainer = make_trainer(tmp_path, extra={"inactive": Inactive()}, steps=2)
    assert "inactive" not in trainer.host.names()
    trainer.train()
    assert Inactive.fired == 0


def test_float16_without_loss_scaler_warns(tmp_path):
    with pytest.warns(UserWarning, match="no enabled plugin scales the loss.*'grad_scaler'"):
        make_trainer(tmp_path, "--training.mixed_precision_param", "float16", steps=1)
