"""The hook trace: plugins, order and time of every hook call; nothing at all when off."""

from __future__ import annotations

import json
import time

import pluggy
import pytest
import torch
import torch.distributed as dist

from plugtrain import hookspecs
from plugtrain.errors import ConfigError
from plugtrain.host.plugin_host import PluginHost
from plugtrain.observability import trace
from plugtrain.observability.trace import HookTracer, format_summary, tracing_requested
from plugtrain.plugin import StepContext, hookimpl, local_tensor
from plugtrain.testing import HookLog, tiny_args
from plugtrain.training.launch import configure
from plugtrain.training.trainer import Trainer


def read_trace(folder, rank: int = 0) -> tuple[list[dict], dict]:
    """The per-call records and the closing summary of a trace file."""
    lines = [json.loads(line) for line in (folder / f"hook_trace.rank{rank}.jsonl").open()]
    assert "summary" in lines[-1]
    return lines[:-1], lines[-1]["summary"]


class Plain:
    def __init__(self, log: list[str], sleep: float = 0.0) -> None:
        self.log, self.sleep = log, sleep

    @hookimpl
    def post_backward(self, ctx):
        time.sleep(self.sleep)
        self.log.append("plain")

    @hookimpl
    def step_metrics(self, ctx):
        return {"x": 1.0}


class First:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    @hookimpl(tryfirst=True)
    def post_backward(self, ctx):
        self.log.append("first")


class Wrapper:
    """A ``wrapper=True`` implementation that sleeps before and after the ones it wraps."""

    def __init__(self, log: list[str], sleep: float) -> None:
        self.log, self.sleep = log, sleep

    @hookimpl(wrapper=True)
    def post_backward(self, ctx):
        time.sleep(self.sleep)
        self.log.append("wrapper before")
        result = yield
        time.sleep(self.sleep)
        self.log.append("wrapper after")
        return result


class Failing:
    @hookimpl
    def pre_step(self, ctx):
        raise RuntimeError("boom")


def step_ctx(step: int) -> StepContext:
    return StepContext(step=step, num_microbatches=1, model=None, optimizer=None, params=())


@pytest.mark.parametrize("reverse", [False, True])
def test_trace_lists_plugins_in_the_order_they_ran_with_their_times(tmp_path, reverse):
    log: list[str] = []
    plugins = [
        ("plain", Plain(log, sleep=0.1)),
        ("first", First(log)),
        ("wrapper", Wrapper(log, sleep=0.01)),
    ]
    host = PluginHost()
    for name, plugin in plugins[::-1] if reverse else plugins:
        host.register(plugin, name)
    tracer = HookTracer.install(host, tmp_path, rank=0)
    host.hook.post_backward(ctx=step_ctx(7))
    host.hook.pre_backward(ctx=step_ctx(7))  # implemented by no plugin
    assert host.results("step_metrics", ctx=step_ctx(7)) == {"plain": {"x": 1.0}}
    tracer.close()

    assert log == ["wrapper before", "first", "plain", "wrapper after"]
    calls, summary = read_trace(tmp_path)
    assert [(c["hook"], c["step"]) for c in calls] == [
        ("post_backward", 7), ("pre_backward", 7), ("step_metrics", 7)
    ]  # fmt: skip
    post_backward = calls[0]
    assert [p["plugin"] for p in post_backward["plugins"]] == ["wrapper", "first", "plain"]
    ms = {p["plugin"]: p["ms"] for p in post_backward["plugins"]}
    assert post_backward["plugins"][0]["wrapper"] is True
    assert ms["plain"] >= 100
    assert 20 <= ms["wrapper"] < 100  # its own code only, not the 100 ms of "plain" it wraps
    assert post_backward["ms"] >= sum(ms.values())
    assert calls[1]["plugins"] == []
    assert [p["plugin"] for p in calls[2]["plugins"]] == ["plain"]
    assert summary["plugins"]["plain"]["post_backward"]["calls"] == 1
    assert summary["plugins"]["plain"]["step_metrics"]["calls"] == 1
    assert summary["hooks"]["pre_backward"]["calls"] == 1


class Loads:
    @hookimpl
    def load_state_dict(self, state_dict):
        pass


def test_call_monitoring_sees_every_result_hook_and_each_state_load():
    host = PluginHost()
    host.register(Plain([]), "plain")
    host.register(Loads(), "loads")
    seen: list[str] = []
    stop = host.monitor_calls(lambda hook, kwargs: seen.append(hook), lambda hook, error: None)
    for hook in hookspecs.RESULT_HOOKS:
        host.results(hook, ctx=step_ctx(1))
    host.call_one("loads", "load_state_dict", state_dict={})
    stop()
    assert seen == [*hookspecs.RESULT_HOOKS, "load_state_dict"]


def test_close_restores_the_plugins_functions_and_removes_monitoring(tmp_path):
    host = PluginHost()
    plain = Plain([])
    host.register(plain, "plain")
    impl = host.hook.post_backward.get_hookimpls()[0]
    tracer = HookTracer.install(host, tmp_path, rank=3)
    assert impl.function != plain.post_backward
    assert host.pm._inner_hookexec is not pluggy._callers._multicall
    tracer.close()
    assert impl.function == plain.post_backward
    assert host.pm._inner_hookexec is pluggy._callers._multicall
    host.hook.post_backward(ctx=step_ctx(1))  # no longer traced
    calls, _ = read_trace(tmp_path, rank=3)
    assert calls == []


def test_a_failing_implementation_is_traced_and_its_error_reaches_the_caller(tmp_path):
    host = PluginHost()
    host.register(Failing(), "failing")
    tracer = HookTracer.install(host, tmp_path, rank=0)
    with pytest.raises(RuntimeError, match="boom"):
        host.results("pre_step", ctx=step_ctx(2))
    host.hook.post_step(ctx=step_ctx(2))
    tracer.close()
    calls, _ = read_trace(tmp_path)
    assert [(c["hook"], c.get("error")) for c in calls] == [
        ("pre_step", "RuntimeError"), ("post_step", None)
    ]  # fmt: skip
    assert [p["plugin"] for p in calls[0]["plugins"]] == ["failing"]


def test_a_traced_run_lists_every_hook_call_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv(trace.ENV_VAR, "1")
    config, host = configure([*tiny_args(tmp_path, steps=3), "--training.grad_accum_steps", "2"])
    log = HookLog()
    host.register(log, "hook_log")
    trainer = Trainer(config, host)
    trainer.run()
    calls, summary = read_trace(tmp_path)
    seen = [(hook, step or 0, mb or 0) for hook, step, mb in log.calls]  # what the plugin saw
    assert seen[:10] == [("convert_model", 0, 0), ("wrap_model", 0, 0), ("compile_model", 0, 0),
                         ("build_optimizer", 0, 0), ("setup", 0, 0), ("build_loss", 0, 0),
                         ("loss_terms", 1, 0), ("pre_backward", 1, 0), ("loss_terms", 1, 1),
                         ("pre_backward", 1, 1)]  # fmt: skip
    traced = [(c["hook"], c["step"] or 0, c["microbatch"] or 0) for c in calls]
    assert traced == seen[4:]  # the tracer is installed once the optimizer is built
    assert all([p["plugin"] for p in c["plugins"]] == ["hook_log"] for c in calls)
    counts = {hook: t["calls"] for hook, t in summary["plugins"]["hook_log"].items()}
    assert counts == {
        "setup": 1, "build_loss": 1, "loss_terms": 6, "pre_backward": 6, "unscale_gradients": 3,
        "observe_gradients": 3, "post_backward": 3, "pre_step": 3, "post_step": 3,
        "step_metrics": 3,
    }  # fmt: skip


def test_tracing_off_installs_nothing_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(trace.ENV_VAR, raising=False)

    def refuse(*args, **kwargs):
        raise AssertionError("tracing is off: no tracer may be built")

    monkeypatch.setattr(HookTracer, "__init__", refuse)
    config, host = configure([*tiny_args(tmp_path, steps=2), "--plugins.enabled", "hook_recorder"])
    trainer = Trainer(config, host)
    trainer.run()
    recorder = trainer.host.get("hook_recorder")
    for hook_name in host.hook_names():
        for impl in getattr(host.hook, hook_name).get_hookimpls():
            assert impl.function == getattr(recorder, hook_name)  # nothing rewritten
    assert host.pm._inner_hookexec is pluggy._callers._multicall  # no monitoring
    assert not list(tmp_path.glob("hook_trace*"))


@pytest.mark.parametrize(
    ("env", "option", "expected"),
    [(None, False, False), (None, True, True), ("1", False, True), ("0", True, False)],
)
def test_environment_variable_overrides_the_option(monkeypatch, env, option, expected):
    if env is None:
        monkeypatch.delenv(trace.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(trace.ENV_VAR, env)
    assert tracing_requested(option) is expected


def test_bad_environment_value_is_one_line(monkeypatch):
    monkeypatch.setenv(trace.ENV_VAR, "verbose")
    with pytest.raises(ConfigError, match=r"PLUGTRAIN_TRACE_HOOKS='verbose': use 1 .* or 0"):
        tracing_requested(False)


def test_summary_table():
    summary = {
        "plugins": {
            "a": {
                "post_backward": {"calls": 4, "ms": 2.0, "syncs": 4, "collectives": 0,
                                  "sync_sites": {"Tensor.item at a:3 (post_backward)": 4}},
                "pre_step": {"calls": 4, "ms": 1.0, "syncs": 0, "collectives": 2},
            },
            "b": {"post_backward": {"calls": 4, "ms": 8.0, "syncs": 0, "collectives": 0}},
        },
        "hooks": {
            "post_backward": {"calls": 4, "ms": 10.5, "syncs": 4, "collectives": 0},
            "pre_step": {"calls": 4, "ms": 1.2, "syncs": 0, "collectives": 2},
        },
    }  # fmt: skip
    assert format_summary(summary).splitlines() == [
        "  plugin        hook           calls  total ms  mean ms  syncs/call  collectives/call",
        "  a             post_backward      4     2.000   0.5000        1.00              0.00",
        "  a             pre_step           4     1.000   0.2500        0.00              0.50",
        "  a             (all)              8     3.000   0.3750        0.50              0.25",
        "  b             post_backward      4     8.000   2.0000        0.00              0.00",
        "  (hook calls)  (all)              8    11.700   1.4625        0.50              0.25",
        "host syncs, by plugin, hook and site:",
        "  a post_backward: 4 x Tensor.item at a:3 (post_backward)",
    ]


class Reads:
    """One host read of each kind per step, in three hooks."""

    @hookimpl
    def post_backward(self, ctx):
        norm = torch.stack([local_tensor(g).norm() for g in ctx.gradients()]).norm()
        bool(norm > 0)
        float(norm)
        norm.reshape(1).tolist()

    @hookimpl
    def pre_step(self, ctx):
        ctx.loss.item()

    @hookimpl
    def post_step(self, ctx):
        pass


class AllReduce:
    @hookimpl
    def post_step(self, ctx):
        dist.all_reduce(torch.ones(1))


class CountingWrapper:
    """A wrapper with one read before its ``yield`` and two after."""

    @hookimpl(wrapper=True)
    def post_backward(self, ctx):
        ctx.loss.item()
        result = yield
        ctx.loss.item()
        ctx.loss.item()
        return result


def test_trace_counts_each_plugins_syncs_and_collectives(tmp_path, monkeypatch):
    monkeypatch.setenv(trace.ENV_VAR, "1")
    config, host = configure(tiny_args(tmp_path, steps=3))
    plugins = {"reads": Reads(), "all_reduce": AllReduce(), "wrapper": CountingWrapper()}
    for name, plugin in plugins.items():
        host.register(plugin, name)
    trainer = Trainer(config, host)
    trainer.run()
    calls, summary = read_trace(tmp_path)

    def costs(plugin: str, hook: str) -> tuple[int, int, int]:
        t = summary["plugins"][plugin][hook]
        return t["calls"], t["syncs"], t["collectives"]

    assert costs("reads", "post_backward") == (3, 9, 0)  # bool, float, tolist
    assert costs("reads", "pre_step") == (3, 3, 0)
    assert costs("reads", "post_step") == (3, 0, 0)  # a no-op costs nothing
    assert costs("wrapper", "post_backward") == (3, 9, 0)  # its own code only, not reads'
    # A world of one process still dispatches c10d ops.
    assert costs("all_reduce", "post_step") == (3, 0, 3)
    assert summary["plugins"]["all_reduce"]["post_step"]["collective_ops"] == {"c10d.allreduce_": 3}
    sites = summary["plugins"]["reads"]["post_backward"]["sync_sites"]
    assert sorted(site.split(" at ")[0] for site in sites) == [
        "Tensor.__bool__", "Tensor.__float__", "Tensor.tolist"
    ]  # fmt: skip
    assert summary["hooks"]["post_backward"]["syncs"] == 18
    [post_backward] = [c for c in calls if c["hook"] == "post_backward" and c["step"] == 2]
    assert (post_backward["syncs"], post_backward["collectives"]) == (6, 0)
    assert {p["plugin"]: p["syncs"] for p in post_backward["plugins"]} == {"wrapper": 3, "reads": 3}
    [post_step] = [c for c in calls if c["hook"] == "post_step" and c["step"] == 2]
    assert {p["plugin"]: p["collectives"] for p in post_step["plugins"]} == {
        "all_reduce": 1, "reads": 0
    }  # fmt: skip
