"""The hook contract, observed through the test kit's HookLog and test plugins."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import DTensor

from plugtrain.host.plugin_host import PluginHost
from plugtrain.plugin import StepContext, full_tensor, hookimpl
from plugtrain.testing import HookLog, make_trainer, read_metrics, tiny_args
from plugtrain.training.launch import configure, run_cli
from plugtrain.training.trainer import Trainer


def expected_calls(steps: int, accum: int) -> list[tuple]:
    calls = [("convert_model", None, None), ("wrap_model", None, None),
             ("compile_model", None, None),
             ("build_optimizer", None, None), ("setup", None, None),
             ("build_loss", None, None)]  # fmt: skip
    for step in range(1, steps + 1):
        for m in range(accum):
            calls += [("loss_terms", step, m), ("pre_backward", step, m)]
        calls += [
            (hook, step, accum - 1)
            for hook in ("unscale_gradients", "observe_gradients", "post_backward", "pre_step",
                         "post_step", "step_metrics")
        ]  # fmt: skip
    return calls


@pytest.mark.parametrize("accum", [1, 2])
def test_exact_hook_sequence(tmp_path, accum):
    log = HookLog()
    trainer = make_trainer(
        tmp_path, "--training.grad_accum_steps", str(accum), plugins=[("log", log)]
    )
    trainer.run()
    assert log.calls == expected_calls(3, accum)
    assert log.skipped_steps() == []


class ContextProbe:
    """Checks what each hook receives, as the hook specification documents it."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.logged_losses: list[float] = []

    @hookimpl
    def pre_backward(self, ctx: StepContext) -> None:
        assert ctx.loss is not None and ctx.loss.requires_grad and ctx.loss.ndim == 0
        assert ctx.num_microbatches == 2
        assert all(p.grad is None for p in ctx.params) or ctx.microbatch > 0
        ctx.loss = ctx.loss * 0.0  # replacing the loss changes what backward sees...
        self.seen.append("pre_backward")

    @hookimpl
    def post_backward(self, ctx: StepContext) -> None:
        grads = ctx.gradients()
        assert len(grads) == len(ctx.params)
        # ...so every gradient is zero, and the step does nothing.
        assert all(torch.count_nonzero(full_tensor(g)) == 0 for g in grads)
        self.seen.append("post_backward")

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        assert not ctx.skipped and ctx.skip_reasons == []
        self.seen.append("post_step")


def test_step_context_contents_and_loss_replacement(tmp_path):
    probe = ContextProbe()
    trainer = make_trainer(
        tmp_path, "--training.grad_accum_steps", "2", "--optimizer.weight_decay", "0",
        plugins=[("probe", probe)], steps=2,
    )  # fmt: skip
    before = [full_tensor(p.detach()).clone() for p in trainer.model.parameters()]
    trainer.run()
    assert probe.seen == ["pre_backward"] * 2 + ["post_backward", "post_step"] * 1 + [
        "pre_backward"
    ] * 2 + ["post_backward", "post_step"]
    after = [full_tensor(p.detach()) for p in trainer.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # The logged loss is the unscaled one, whatever pre_backward did to ctx.loss.
    losses = [r["loss"] for r in read_metrics(tmp_path) if "loss" in r]
    assert all(loss > 5.0 for loss in losses)


def test_veto_skips_optimizer_and_lr_schedule(tmp_path):
    log = HookLog()
    trainer = make_trainer(
        tmp_path, "--plugins.enabled", "hook_recorder", "--hook_recorder.veto_steps", "[2]",
        plugins=[("log", log)],
    )  # fmt: skip
    params = {}
    lrs = {}

    class Snapshot:
        @hookimpl
        def pre_step(self, ctx):
            params[ctx.step] = [full_tensor(p.detach()).clone() for p in ctx.params]
            lrs[ctx.step] = int(trainer.lr_scheduler.applied_steps)

        @hookimpl
        def post_step(self, ctx):
            same = all(
                torch.equal(a, full_tensor(p.detach()))
                for a, p in zip(params[ctx.step], ctx.params, strict=True)
            )
            assert same == bool(ctx.skipped), f"step {ctx.step}: parameters changed={not same}"
            applied = int(trainer.lr_scheduler.applied_steps)
            assert applied == lrs[ctx.step] + (0 if ctx.skipped else 1)

    trainer.host.register(Snapshot(), "snapshot")
    trainer.run()
    assert log.skipped_steps() == [2]
    assert int(trainer.lr_scheduler.applied_steps) == 2  # 3 steps, one vetoed
    assert int(trainer.vetoes.total) == 1


class NormReader:
    """Reads the total gradient norm of each step, keeping it on the device."""

    def __init__(self) -> None:
        self.norms: list[torch.Tensor] = []

    def read(self, ctx: StepContext) -> None:
        norm = torch.nn.utils.get_total_norm(ctx.gradients(), foreach=True)
        self.norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)


class NormProbe(NormReader):
    """A third-party observer, in the observe phase."""

    @hookimpl
    def observe_gradients(self, ctx: StepContext) -> None:
        self.read(ctx)


class ModifyPhaseProbe(NormReader):
    """The same reading in the modify phase, where clipping runs too: a control."""

    @hookimpl
    def post_backward(self, ctx: StepContext) -> None:
        self.read(ctx)


def run_in_order(tmp_path, order: tuple[str, ...], probe: NormReader, *args: str) -> Trainer:
    """Train 4 steps with the plugins registered exactly in ``order`` ("probe" is ``probe``)."""
    config, host = configure([
        *tiny_args(tmp_path, steps=4), "--plugins.enabled", "grad_clip,grad_scaler",
        "--grad_clip.max_norm", "0.05", *args,
    ])  # fmt: skip
    plugins = {name: host.get(name) for name in host.names()} | {"probe": probe}
    for name in host.names():
        host.unregister(plugins[name])
    for name in order:
        host.register(plugins[name], name)
    trainer = Trainer(config, host)
    trainer.run()
    return trainer


TIMINGS = ("time_", "tokens_", "tflops", "mfu_", "memory_")


def numbers(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMINGS)} for r in records]


FP16_OVERFLOWING = (
    "--training.mixed_precision_param", "float16", "--grad_scaler.init_scale", "1e6",
    "--grad_scaler.growth_interval", "1",
)  # fmt: skip
"""float16 with a scale that overflows at first: steps skip, the scale backs off and grows."""


def test_gradient_phases_make_every_plugin_order_give_the_same_run(tmp_path):
    runs = []
    for i, order in enumerate(itertools.permutations(("probe", "grad_clip", "grad_scaler"))):
        probe = NormProbe()
        trainer = run_in_order(tmp_path / str(i), order, probe, *FP16_OVERFLOWING)
        params = [full_tensor(p.detach()) for p in trainer.model.parameters()]
        runs.append((order, probe.norms, params, numbers(read_metrics(tmp_path / str(i)))))
    (_, norms, params, records), *others = runs
    assert 0 < int(records[-1]["skipped_steps"]) < 4  # the scaler skipped, and stepped
    assert max(n for n in norms if n.isfinite()) > 0.05  # the true norms, which grad_clip clips
    for order, other_norms, other_params, other_records in others:
        assert all(torch.equal(a, b) for a, b in zip(norms, other_norms, strict=True)), order
        assert all(torch.equal(a, b) for a, b in zip(params, other_params, strict=True)), order
        assert other_records == records, order


def test_an_observer_in_the_modify_phase_depends_on_the_order(tmp_path):
    """The control: read in post_backward, the norm is clipped or not by registration order."""
    seen = []
    for i, order in enumerate([("probe", "grad_clip"), ("grad_clip", "probe")]):
        probe = ModifyPhaseProbe()
        run_in_order(tmp_path / str(i), (*order, "grad_scaler"), probe)
        seen.append(torch.stack(probe.norms))
    # pluggy calls the plugin registered last first: grad_clip, then the probe, in order 0.
    assert torch.allclose(seen[0], torch.tensor(0.05))
    assert (seen[1] > 0.5).all()


def test_deactivated_plugin_never_fires_again(tmp_path):
    class Inactive:
        fired = 0

        @hookimpl
        def setup(self, ctx):
            ctx.deactivate(self, "nothing to do")

        @hookimpl
        def pre_backward(self, ctx):
            Inactive.fired += 1

    trainer = make_trainer(tmp_path, plugins=[("inactive", Inactive())], steps=2)
    assert "inactive" not in trainer.host.names()
    trainer.run()
    assert Inactive.fired == 0


def test_float16_without_loss_scaler_warns(tmp_path):
    with pytest.warns(UserWarning, match="no enabled plugin scales the loss.*'grad_scaler'"):
        make_trainer(tmp_path, "--training.mixed_precision_param", "float16", steps=1)


class BadVeto:
    def __init__(self, answer: object) -> None:
        self.answer = answer

    @hookimpl
    def pre_step(self):
        return self.answer


@pytest.mark.parametrize(
    ("answer", "what"),
    [
        (1.0, "float 1.0"),
        (torch.tensor(True).expand(2), "a torch.bool tensor of shape [2]"),
        (torch.tensor(1.0), "a torch.float32 tensor of shape []"),
    ],
)
def test_a_wrong_veto_is_a_one_line_error_naming_the_plugin_and_the_hook(
    tmp_path, capsys, answer, what
):
    trainer = make_trainer(tmp_path, plugins=[("bad", BadVeto(answer))], steps=2)
    assert run_cli(trainer.train) == 2
    trainer.abort()
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line == (
        f"plugtrain: error: plugin 'bad': pre_step returned {what}; return None, a reason "
        "string, or a 0-d bool tensor on the training device (true: skip the step)"
    )


def test_a_device_veto_skips_without_a_reason_and_counts_for_its_plugin(tmp_path):
    class SkipEven:
        @hookimpl
        def pre_step(self, ctx):
            return torch.tensor(ctx.step % 2 == 0)

    trainer = make_trainer(tmp_path, plugins=[("even", SkipEven())], steps=4)
    trainer.run()
    assert int(trainer.vetoes.total) == 2 and int(trainer.vetoes.by_plugin["even"]) == 2
    assert int(trainer.lr_scheduler.applied_steps) == 2
    records = read_metrics(tmp_path)
    assert [r["skipped_steps.even"] for r in records] == [0, 1, 1, 2]


class Answers:
    """Answers every result hook with its plugin name; records the order it was asked in."""

    def __init__(self, name: str, asked: list[str]) -> None:
        self.name, self.asked = name, asked

    @hookimpl
    def pre_step(self, ctx):
        self.asked.append(self.name)
        return None if self.name == "b" else self.name

    @hookimpl
    def state_dict(self):
        return {"name": self.name}


@pytest.mark.parametrize("order", list(itertools.permutations("abc")))
def test_result_hooks_answer_in_name_order_whatever_the_registration_order(order):
    host, asked = PluginHost(), []
    for name in order:
        host.register(Answers(name, asked), name)
    ctx = StepContext(step=1, num_microbatches=1, model=None, optimizer=None, params=())
    vetoes = host.results("pre_step", ctx=ctx)
    assert list(vetoes.items()) == [("a", "a"), ("c", "c")]  # None answers are left out
    assert asked == ["a", "b", "c"]
    assert list(host.results("state_dict")) == ["a", "b", "c"]
    with pytest.raises(ValueError, match="'post_step' is not a result hook"):
        host.results("post_step", ctx=ctx)
