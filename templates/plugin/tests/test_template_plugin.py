"""template_plugin on its own: its config section, its hooks, and tiny real runs.

These tests import only the plugin API and the test kit (``plugtrain.testing``), whose
``plugtrain_run`` fixture comes with plugtrain: no conftest is needed.
"""

from __future__ import annotations

import pytest
import torch
from plugtrain_template_plugin import TemplatePlugin

from plugtrain.plugin import ConfigError
from plugtrain.testing import assert_costs, count_costs, setup_context, step_context

NAME = "template_plugin"
ENABLED = ("--plugins.enabled", NAME)
HALF = (*ENABLED, "--template_plugin.factor", "0.5")


def test_config_section_is_typed_and_checked():
    plugin = TemplatePlugin()
    ctx = setup_context({NAME: plugin}, *HALF)
    plugin.setup(ctx)
    assert plugin.config.factor == 0.5
    assert ctx.deactivations == {}
    message = r"config key 'template_plugin\.factor' must be > 0, got -1"
    with pytest.raises(ConfigError, match=message):
        setup_context({}, *ENABLED, "--template_plugin.factor", "-1")


def test_a_factor_of_one_deactivates_the_plugin():
    plugin = TemplatePlugin()
    ctx = setup_context({NAME: plugin}, *ENABLED)
    plugin.setup(ctx)
    assert ctx.deactivations == {plugin: "factor is 1.0: nothing to do"}


def test_post_backward_multiplies_every_gradient():
    ctx = step_context()
    before = [g.clone() for g in ctx.gradients()]
    plugin = TemplatePlugin()
    plugin.config.factor = 0.5
    plugin.post_backward(ctx)
    for grad, old in zip(ctx.gradients(), before, strict=True):
        torch.testing.assert_close(grad, old * 0.5)


def test_a_tiny_run_logs_the_factor_and_changes_the_training(plugtrain_run):
    plain = plugtrain_run()
    scaled = plugtrain_run(*HALF)
    assert [r[f"{NAME}/factor"] for r in scaled.metrics if "loss" in r] == [0.5] * 3
    assert "post_backward" in scaled.hooks_fired()
    assert scaled.checksums != plain.checksums


def test_no_host_sync_on_a_non_logging_step(tmp_path):
    assert_costs(count_costs(tmp_path, *HALF, plugin=NAME), syncs=0, collectives={})
