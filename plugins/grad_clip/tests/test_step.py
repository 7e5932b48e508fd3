"""grad_clip in a 1-process run: when it clips, what it sees, and what it costs when disabled."""

from __future__ import annotations

import sys
from importlib.metadata import entry_points

import pytest
import torch

from plugtrain.plugin import full_tensor, hookimpl
from plugtrain.testing import make_trainer, read_metrics


def params_of(trainer) -> list[torch.Tensor]:
    return [full_tensor(p.detach()) for p in trainer.model.parameters()]


@pytest.mark.parametrize("accum", [1, 2])
def test_computes_and_clips_once_per_optimizer_step(tmp_path, monkeypatch, accum, clip_args):
    calls = {"get_total_norm": 0, "clip_grads_with_norm_": 0}
    for name in calls:
        original = getattr(torch.nn.utils, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(torch.nn.utils, name, counted)
    trainer = make_trainer(
        tmp_path, *clip_args(0.1), "--training.grad_accum_steps", str(accum), steps=3
    )
    trainer.run()
    assert calls == {"get_total_norm": 3, "clip_grads_with_norm_": 3}
    assert [r["grad_clip/clipped"] for r in read_metrics(tmp_path)] == [1.0, 1.0, 1.0]


def test_below_max_norm_changes_nothing(tmp_path, clip_args):
    plain = make_trainer(tmp_path / "plain", steps=2)
    plain.run()
    clip = make_trainer(tmp_path / "clip", *clip_args(1e6), steps=2)
    clip.run()
    records = read_metrics(tmp_path / "clip")
    assert [r["grad_clip/clipped"] for r in records] == [0.0, 0.0]
    assert all(0 < r["grad_clip/grad_norm"] < 1e6 for r in records)
    assert all(torch.equal(a, b) for a, b in zip(params_of(plain), params_of(clip), strict=True))


class LossScalerStandIn:
    """Scales the loss by 2**16 and unscales in the "run first" slot, like a loss scaler."""

    factor = 2.0**16

    @hookimpl
    def pre_backward(self, ctx):
        ctx.loss = ctx.loss * self.factor

    @hookimpl(tryfirst=True)
    def post_backward(self, ctx):
        for grad in ctx.gradients():
            grad.div_(self.factor)


@pytest.mark.parametrize("scaler_first", [True, False])
def test_clips_unscaled_gradients_in_both_registration_orders(tmp_path, scaler_first, clip_args):
    plain = make_trainer(tmp_path / "plain", *clip_args(0.1), steps=3)
    plain.run()
    order = [("scaler", LossScalerStandIn()), ("grad_clip", None)]
    scaled = make_trainer(
        tmp_path / "scaled",
        *clip_args(0.1),
        plugins=order if scaler_first else order[::-1],
        steps=3,
    )
    scaled.run()
    norms = [r["grad_clip/grad_norm"] for r in read_metrics(tmp_path / "scaled")]
    assert norms == pytest.approx(
        [r["grad_clip/grad_norm"] for r in read_metrics(tmp_path / "plain")]
    )
    assert max(norms) < 10  # the scaled gradients' norm would be 2**16 times larger
    for a, b in zip(params_of(plain), params_of(scaled), strict=True):
        torch.testing.assert_close(a, b)


def test_installed_but_not_enabled_is_never_imported(tmp_path, monkeypatch, clip_args):
    installed = entry_points(group="plugtrain.plugins", name="grad_clip")
    assert {ep.dist.name for ep in installed if ep.dist} == {"plugtrain-grad-clip"}
    monkeypatch.delitem(sys.modules, "plugtrain_grad_clip", raising=False)
    make_trainer(tmp_path / "off", "--plugins.enabled", "hook_recorder", steps=1).run()
    assert "plugtrain_grad_clip" not in sys.modules
    make_trainer(tmp_path / "on", *clip_args(1.0), steps=1)
    assert "plugtrain_grad_clip" in sys.modules
