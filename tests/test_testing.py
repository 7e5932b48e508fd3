"""The plugin author's test kit, plugtrain.testing: its runs, injectors and counters."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from plugtrain.data import ChatTemplate, Tokenizer
from plugtrain.data.chat import encode_conversation
from plugtrain.data.prepare import prepare
from plugtrain.plugin import StepContext, hookimpl
from plugtrain.testing import (
    SAMPLE,
    HookLog,
    InjectInf,
    assert_costs,
    check_order_independence,
    count_costs,
    run_distributed,
    setup_context,
    step_context,
    stored_documents,
    tiny_run,
)

STEP_HOOKS = [
    "loss_terms",
    "pre_backward",
    "unscale_gradients",
    "observe_gradients",
    "post_backward",
    "pre_step",
    "post_step",
    "step_metrics",
]


class ItemEveryStep:
    """Reads a gradient on the host once per step: the deliberate sync the counters must see."""

    @hookimpl
    def post_backward(self, ctx: StepContext) -> None:
        ctx.gradients()[0].sum().item()


class AddOne:
    """Adds 1 to every gradient: does not commute with clipping, so it depends on the order."""

    @hookimpl
    def post_backward(self, ctx: StepContext) -> None:
        for grad in ctx.gradients():
            grad.add_(1.0)


def test_a_tiny_run_reports_losses_hooks_checksums_and_skips(tmp_path):
    run = tiny_run(
        tmp_path, "--plugins.enabled", "hook_recorder", "--hook_recorder.veto_steps", "[2]"
    )
    assert sorted(run.losses) == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(loss)) for loss in run.losses.values())
    assert [r["step"] for r in run.metrics if "loss" in r] == [1, 2, 3]
    assert len(run.checksums) == 1 and len(run.checksums[0]) == 64
    assert run.skipped_steps == [2]
    expected = [("convert_model", None, None), ("wrap_model", None, None),
                ("compile_model", None, None), ("build_optimizer", None, None),
                ("setup", None, None), ("build_loss", None, None)]  # fmt: skip
    for step in (1, 2, 3):
        expected += [(hook, step, 0) for hook in STEP_HOOKS]
    assert run.hooks == expected


def test_a_tiny_run_is_deterministic_and_sees_its_plugins(tmp_path):
    first = tiny_run(tmp_path / "a")
    again = tiny_run(tmp_path / "b")
    clipped = tiny_run(
        tmp_path / "c", "--plugins.enabled", "grad_clip", "--grad_clip.max_norm", "0.01"
    )
    assert first.checksums == again.checksums and first.losses == again.losses
    assert clipped.checksums != first.checksums


@pytest.mark.parametrize("where", ["gradients", "loss"])
def test_inject_inf_makes_the_loss_scaler_skip_that_step(tmp_path, where):
    run = tiny_run(
        tmp_path, "--plugins.enabled", "grad_scaler", "--training.mixed_precision_param",
        "float16", plugins=[("inject", InjectInf(steps=[2], where=where))],
    )  # fmt: skip
    assert run.skipped_steps == [2]


def test_inject_inf_refuses_an_unknown_place():
    with pytest.raises(ValueError, match="where must be"):
        InjectInf(steps=[1], where="weights")


def test_step_context_is_real_and_calls_one_hook():
    ctx = step_context(step=4, skipped=True)
    before = [g.clone() for g in ctx.gradients()]
    AddOne().post_backward(ctx)
    assert ctx.step == 4 and bool(ctx.skipped) and len(before) == 4
    for grad, old in zip(ctx.gradients(), before, strict=True):
        torch.testing.assert_close(grad, old + 1)


def test_setup_context_resolves_the_plugins_config():
    plugin = object()
    ctx = setup_context(
        {"grad_clip": plugin}, "--plugins.enabled", "grad_clip", "--grad_clip.max_norm", "2"
    )
    assert ctx.plugin_config(plugin).max_norm == 2.0
    ctx.register_loss_scaler(plugin)
    assert ctx.loss_scaler == "grad_clip"


def test_count_costs_sees_one_deliberate_sync_per_step(tmp_path):
    plugins = [("item", ItemEveryStep())]
    whole = count_costs(tmp_path / "whole", plugins=plugins)
    mine = count_costs(tmp_path / "mine", plugin="item", plugins=plugins)
    assert whole.syncs == 1 and mine.syncs == 1
    # The time per step is a difference of two runs' totals: reported, never asserted on.
    assert mine.collectives == {} and mine.ms is not None and whole.ms is None
    assert any("post_backward" in site for site in mine.sync_sites), mine.sync_sites
    assert_costs(mine, syncs=1, collectives={})
    with pytest.raises(AssertionError, match="1 host syncs per non-logging step, expected 0"):
        assert_costs(mine, syncs=0)


def test_count_costs_of_grad_clip_is_zero_syncs(tmp_path):
    costs = count_costs(tmp_path, "--plugins.enabled", "grad_clip", plugin="grad_clip")
    assert_costs(costs, syncs=0, collectives={})  # a world of one needs no all-reduce


def test_order_independence_passes_commuting_plugins_and_fails_others(tmp_path):
    sums = check_order_independence(
        tmp_path / "ok", "grad_clip", "--grad_clip.max_norm", "0.01", others=["hook_recorder"]
    )
    assert len(sums) == 1
    with pytest.raises(AssertionError, match="depend on the registration order"):
        check_order_independence(
            tmp_path / "bad", ("add_one", AddOne), "--grad_clip.max_norm", "0.01",
            others=["grad_clip"],
        )  # fmt: skip


def test_the_hook_log_implements_every_hook_but_config_section():
    from plugtrain.host.plugin_host import PluginHost

    implemented = [h for h in PluginHost.hook_names() if hasattr(HookLog, h)]
    assert implemented == [h for h in PluginHost.hook_names() if h != "config_section"]


def test_the_plugtrain_run_fixture_trains_in_its_own_folder(plugtrain_run):
    first, second = plugtrain_run(steps=2), plugtrain_run(steps=2)
    assert first.dump_folder != second.dump_folder
    assert first.checksums == second.checksums and sorted(first.losses) == [1, 2]


def rank_and_world() -> tuple[int, int]:
    """Run on each rank: a module-level function of a test file, loaded there from its file."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


@pytest.mark.slow
def test_run_distributed_runs_a_test_files_function_on_each_rank():
    assert run_distributed(rank_and_world, 2) == [(0, 2), (1, 2)]


@pytest.mark.slow
def test_a_two_process_run_matches_the_contract_on_every_rank(tmp_path):
    args = ("--plugins.enabled", "hook_recorder", "--hook_recorder.veto_steps", "[2]")
    run = tiny_run(tmp_path, *args, world_size=2)
    assert len(run.checksums) == 2 and run.checksums[0] != run.checksums[1]  # two shards
    assert [r["skipped_steps"] for r in run.per_rank] == [[2], [2]]
    assert run.per_rank[0]["hooks"] == run.per_rank[1]["hooks"] == run.hooks
    assert sorted(run.losses) == [1, 2, 3]


def test_stored_documents_reads_each_conversation_back_across_shards(tmp_path):
    chat = SAMPLE / "chat_validation.jsonl"
    tokenizer = Tokenizer.from_file(SAMPLE / "tokenizer.json")
    template = ChatTemplate.for_tokenizer(SAMPLE / "tokenizer.json")
    # Chunks of about 2 kB closing shards of 500 tokens: several shards.
    folder = prepare([str(chat)], tmp_path / "out", SAMPLE / "tokenizer.json", workers=1,
                     shard_tokens=500, chunk_bytes=2048, progress=False).folder  # fmt: skip
    assert len(json.loads((folder / "manifest.json").read_text())["shards"]) > 2
    expected = [
        encode_conversation(json.loads(line)["messages"], template, tokenizer)[0]
        for line in chat.read_text().splitlines()
    ]
    assert stored_documents(folder) == expected


def test_peak_memory_counts_the_tensors_alive_at_once():
    from plugtrain.testing import PeakMemory

    with PeakMemory() as memory:
        a = torch.ones(1000)  # 4000 bytes
        b = a[:10]  # a view: no new memory
        c = torch.ones(500)  # 2000 more: 6000 alive
        del a, b, c
        d = torch.ones(250)  # 1000, after 6000 were freed
    assert (memory.peak, memory.live) == (6000, 1000)
    del d


def test_every_public_name_imports_from_the_package():
    import plugtrain.testing as kit

    assert [name for name in kit.__all__ if getattr(kit, name, None) is None] == []
    with pytest.raises(AttributeError, match="has no attribute 'tiny_runs'"):
        kit.tiny_runs  # noqa: B018


PROBE = """
import os, sys

def pytest_collection_finish(session):
    print("kit plugin loaded:", "plugtrain.testing.pytest_plugin" in sys.modules)
    print("PLUGTRAIN_CACHE:", os.environ.get("PLUGTRAIN_CACHE"))
"""


def pytest_collect_only(tmp_path, *options: str) -> tuple[str, set[str]]:
    """``python -X importtime -m pytest --co -q`` in an empty folder (with a probe plugin that
    prints what the session did); its output, and the torch modules it imported."""
    (tmp_path / "probe").mkdir(exist_ok=True)
    (tmp_path / "probe" / "kit_probe.py").write_text(PROBE)
    (tmp_path / "empty").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PLUGTRAIN_CACHE"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "probe"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pytest", "--co", "-q", "-p", "kit_probe",
         *options],
        cwd=tmp_path / "empty", env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 5, done.stdout + done.stderr  # 5: no tests collected
    # -X importtime lists every module an import statement imports, one a line.
    names = {line.split("|")[-1].strip() for line in done.stderr.splitlines()}
    return done.stdout, {name for name in names if name.split(".")[0] == "torch"}


def test_loading_the_pytest_plugin_imports_no_torch_and_sets_no_variable(tmp_path):
    out, torch_modules = pytest_collect_only(tmp_path)
    assert "kit plugin loaded: True" in out
    assert "PLUGTRAIN_CACHE: None" in out
    _, without_the_kit = pytest_collect_only(tmp_path, "-p", "no:plugtrain")
    assert torch_modules - without_the_kit == set()
