"""The example plugin on its own: its config section and its veto."""

from __future__ import annotations

import pytest
from plugtrain_hook_recorder import HookRecorder, HookRecorderConfig

from plugtrain.plugin import ConfigError
from plugtrain.testing import setup_context, step_context


def section(**values) -> HookRecorderConfig:
    """The [hook_recorder] section a run validates from ``values``, as TOML gives them."""
    plugin = HookRecorder()
    ctx = setup_context(
        {"hook_recorder": plugin}, "--plugins.enabled", "hook_recorder",
        values={"hook_recorder": values},
    )  # fmt: skip
    return ctx.plugin_config(plugin)


def test_config_section_is_typed():
    assert section(veto_steps=[2, 5]).veto_steps == [2, 5]
    with pytest.raises(ConfigError, match=r"config key 'hook_recorder\.veto_steps' must be int"):
        section(veto_steps=["x"])


def test_vetoes_only_the_configured_steps():
    plugin = HookRecorder()
    plugin.config = HookRecorderConfig(veto_steps=[2])
    assert plugin.pre_step(step_context(step=2)) == "hook_recorder vetoes step 2 (veto_steps)"
    assert plugin.pre_step(step_context(step=3)) is None
    assert plugin.step_metrics(step_context(step=3)) == {"vetoed_steps": 1}
