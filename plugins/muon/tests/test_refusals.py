"""What the muon plugin refuses before step 1, in one line."""

from __future__ import annotations

import pytest
import torch
from plugtrain_muon import MuonPlugin

from plugtrain.plugin import ConfigError, OptimizerContext
from plugtrain.testing import setup_context


def test_tensor_parallelism_is_refused_in_one_line():
    plugin = MuonPlugin()
    setup = setup_context({"muon": plugin}, "--plugins.enabled", "muon", "--parallelism.tp", "2")
    ctx = OptimizerContext(
        config=setup.config,
        named_parameters=(),
        optimizer_config=setup.config.optimizer,
        mesh=setup.mesh,
        device=torch.device("cpu"),
        rank=0,
        world_size=1,
        name_of=setup.name_of,
    )
    with pytest.raises(ConfigError) as refused:
        plugin.build_optimizer(ctx=ctx)
    assert str(refused.value) == (
        "plugin 'muon' does not run under tensor parallelism yet (parallelism.tp = 2): "
        "remove 'muon' from plugins.enabled, or set parallelism.tp = 1"
    )
