"""The example plugin on its own: its config section and its veto."""

from __future__ import annotations

import pytest
import torch
from plugtrain_hook_recorder import HookRecorder, HookRecorderConfig

from plugtrain.config import build_config
from plugtrain.errors import ConfigError
from plugtrain.plugin import StepContext


def step_context(step: int) -> StepContext:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return StepContext(step, 1, model, optimizer, tuple(model.parameters()))


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
    assert plugin.pre_step(step_context(2)) == "hook_recorder vetoes step 2 (veto_steps)"
    assert plugin.pre_step(step_context(3)) is None
    assert [c.hook for c in plugin.calls] == ["pre_step", "pre_step"]
