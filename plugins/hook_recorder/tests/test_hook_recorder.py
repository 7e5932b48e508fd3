"""The example plugin on its own: its config section and its veto."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from plugtrain_hook_recorder import HookRecorder, HookRecorderConfig

from plugtrain.config import build_config
from plugtrain.errors import ConfigError


def test_config_section_is_typed():
    cfg = build_config(
        {"hook_recorder": {"veto_steps": [2, 5]}}, {"hook_recorder": HookRecorderConfig}
    )
    assert cfg.plugin("hook_recorder").veto_steps == [2, 5]
    with pytest.raises(ConfigError, match=r"config key 'hook_recorder\.veto_steps' must be int"):
        build_config(
            {"hook_recorder": {"veto_steps": ["x"]}}, {"hook_recorder": HookRecorderConfig}
        )


def test_vetoes_only_the_configured_steps():
    plugin = HookRecorder()
    plugin.config = HookRecorderConfig(veto_steps=[2])
    assert plugin.pre_step(SimpleNamespace(step=2, microbatch=0)) == (
        "hook_recorder vetoes step 2 (veto_steps)"
    )
    assert plugin.pre_step(SimpleNamespace(step=3, microbatch=0)) is None
    assert [c.hook for c in plugin.calls] == ["pre_step", "pre_step"]
