"""template_plugin on its own: its config section and its hook, on a tiny model."""

from __future__ import annotations

import pytest
import torch
from plugtrain_template_plugin import (
    TemplatePlugin,
    TemplatePluginConfig,
)

from plugtrain.config import build_config
from plugtrain.errors import ConfigError
from plugtrain.plugin import StepContext, gradients


def test_config_section_is_typed_and_checked():
    sections = {"template_plugin": TemplatePluginConfig}
    cfg = build_config({"template_plugin": {"factor": 0.5}}, sections)
    assert cfg.plugin("template_plugin").factor == 0.5
    message = r"config key 'template_plugin\.factor' must be > 0, got -1"
    with pytest.raises(ConfigError, match=message):
        build_config({"template_plugin": {"factor": -1.0}}, sections)


def test_post_backward_multiplies_every_gradient():
    model = torch.nn.Linear(3, 2)
    model(torch.ones(4, 3)).sum().backward()
    before = [g.clone() for g in gradients(model)]
    plugin = TemplatePlugin()
    plugin.config = TemplatePluginConfig(factor=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plugin.post_backward(StepContext(1, 1, model, optimizer, tuple(model.parameters())))
    for grad, old in zip(gradients(model), before, strict=True):
        torch.testing.assert_close(grad, old * 0.5)
