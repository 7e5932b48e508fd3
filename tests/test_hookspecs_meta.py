"""Meta-tests of the hook contract: every hook fires in a real run, and every hook's docstring
says what it is in one line and how often it fires."""

from __future__ import annotations

import inspect
import re
import warnings

import pytest

from plugtrain import hookspecs
from plugtrain.host.plugin_host import PluginHost
from plugtrain.plugin import hookimpl
from plugtrain.testing import SAMPLE, HookLog, interrupted_and_resumed

HOOKS = PluginHost.hook_names()
HOW_OFTEN = re.compile(r"\b(once|per step|every|each)\b")
"""Words that say how often a hook fires."""


def test_the_contract_declares_the_hooks_the_trainer_fires():
    # A hook added to hookspecs.py must be added here (and to the run below) on purpose.
    assert HOOKS == [
        "config_section", "convert_model", "wrap_model", "compile_model", "build_optimizer",
        "setup", "build_loss", "loss_terms", "pre_backward", "unscale_gradients",
        "observe_gradients", "post_backward", "pre_step", "post_step", "step_metrics",
        "validation_weights", "pre_validation", "validation_metrics", "post_validation",
        "state_dict", "load_state_dict", "checkpoint_saved", "checkpoint_loaded",
    ]  # fmt: skip


def test_every_hook_fires_in_a_stopped_and_resumed_run(tmp_path, monkeypatch):
    # config_section fires while plugins load, before any object can be registered to log it:
    # it is seen through the host, which asks each enabled plugin for its section.
    asked = []
    results = PluginHost.results

    def spying_results(self, hook_name, **kwargs):
        asked.append(hook_name)
        return results(self, hook_name, **kwargs)

    monkeypatch.setattr(PluginHost, "results", spying_results)
    logs: list[HookLog] = []

    def plugins():
        logs.append(HookLog())
        return [("hook_log", logs[-1])]

    validation = ("--validation.interval", "4", "--validation.steps", "1",
                  "--data.validation_path", str(SAMPLE / "validation.jsonl"))  # fmt: skip
    result = interrupted_and_resumed(
        tmp_path,
        "--plugins.enabled",
        "grad_clip",
        *validation,
        steps=4,
        stop_after=2,
        plugins=plugins,
    )
    assert result["resumed"] == result["straight"]
    resumed = logs[-1]  # the third run: resumed from the stopped one's checkpoint
    fired = set(resumed.hooks_fired()) | {hook for hook in asked if hook == "config_section"}
    assert sorted(fired, key=HOOKS.index) == HOOKS
    # The model hooks fire before setup; on resume, state_dict gives the structure the
    # checkpoint's values are loaded into.
    assert [hook for hook, _, _ in resumed.calls[:9]] == [
        "convert_model", "wrap_model", "compile_model", "build_optimizer", "setup", "build_loss",
        "state_dict", "load_state_dict", "checkpoint_loaded",
    ]  # fmt: skip
    assert ("pre_backward", 3, 0) in resumed.calls and ("pre_backward", 2, 0) not in resumed.calls


def doc_problem(doc: str | None) -> str | None:
    """What a hook's docstring lacks, or None: a one-line summary, then a blank line, and
    words saying how often the hook fires."""
    if not doc:
        return "no docstring"
    summary, _, rest = doc.partition("\n")
    if not summary.endswith(".") or (rest and not rest.startswith("\n")):
        return f"the first line is not a one-line summary: {summary!r}"
    if not HOW_OFTEN.search(doc):
        return "it does not say how often the hook fires"
    return None


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented_in_one_line_then_how_often_it_fires(hook):
    assert doc_problem(inspect.getdoc(getattr(hookspecs, hook))) is None, hook


def test_the_docstring_check_catches_what_it_must():
    assert doc_problem("Fires once per run, after the model\nis built.\n\nMore.")
    assert doc_problem("Return the state.\n\nSaved with the checkpoint.")  # how often?
    assert doc_problem(None)
    assert doc_problem("Fires once per step.\n\nMore.") is None


def test_a_hook_declared_with_warn_on_impl_warns_each_plugin_that_implements_it(monkeypatch):
    # How the core keeps a renamed hook for one minor version (docs/writing-plugins.md): the
    # old spec stays in hookspecs.py, marked, and the trainer fires it beside the new one.
    @hookspecs.hookspec(
        warn_on_impl=DeprecationWarning(
            "hook 'old_name' is renamed 'new_name' (plugin API 1.1) and goes in 1.2"
        )
    )
    def old_name(ctx: object) -> None:
        """Fires once per step (a throwaway spec of this test)."""

    class Implements:
        @hookimpl
        def old_name(self, ctx):
            pass

    class DoesNot:
        @hookimpl
        def post_step(self, ctx):
            pass

    monkeypatch.setattr(hookspecs, "old_name", old_name, raising=False)
    host = PluginHost()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        host.register(DoesNot(), "does_not")
    with pytest.warns(DeprecationWarning, match=r"'old_name' is renamed 'new_name'") as caught:
        host.register(Implements(), "implements")
    # Told at the plugin's own line, so that its author knows what to change.
    assert (caught[0].filename, caught[0].lineno) == (
        __file__,
        Implements.old_name.__code__.co_firstlineno,
    )
