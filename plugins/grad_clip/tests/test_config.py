"""The [grad_clip] config section: defaults, inf, and every invalid value by its message."""

from __future__ import annotations

import math

import pytest
from plugtrain_grad_clip import GradClipConfig

from plugtrain.plugin import ConfigError
from plugtrain.testing import setup_context

ENABLE = ("--plugins.enabled", "grad_clip")


def section(*args: str, **values) -> GradClipConfig:
    """The [grad_clip] section a run validates from ``values`` (as TOML gives them) and
    ``args``."""
    plugin = object()
    ctx = setup_context({"grad_clip": plugin}, *ENABLE, *args, values={"grad_clip": values})
    return ctx.plugin_config(plugin)


def test_defaults():
    assert section() == GradClipConfig(max_norm=1.0, norm_type=2.0, on_nonfinite="skip")


def test_inf_norm_from_the_command_line_and_toml(tmp_path):
    toml = tmp_path / "clip.toml"
    toml.write_text('[plugins]\nenabled = ["grad_clip"]\n[grad_clip]\nnorm_type = inf\n')
    plugin = object()
    ctx = setup_context({"grad_clip": plugin}, "--config", str(toml))
    assert ctx.plugin_config(plugin).norm_type == math.inf
    assert ctx.config.plugins.enabled == ["grad_clip"]
    assert section(
        "--grad_clip.norm_type", "inf", "--grad_clip.max_norm", "0.5",
        "--grad_clip.on_nonfinite", "raise",
    ) == GradClipConfig(0.5, math.inf, "raise")  # fmt: skip


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_norm": 0}, "config key 'grad_clip.max_norm' must be finite and > 0, got 0.0"),
        ({"max_norm": -1.0}, "config key 'grad_clip.max_norm' must be finite and > 0, got -1.0"),
        ({"max_norm": math.inf}, "config key 'grad_clip.max_norm' must be finite and > 0, got inf"),
        ({"max_norm": math.nan}, "config key 'grad_clip.max_norm' must be finite and > 0, got nan"),
        ({"max_norm": "big"}, "config key 'grad_clip.max_norm' must be float, got 'big'"),
        ({"norm_type": 0}, "config key 'grad_clip.norm_type' must be > 0 .*, got 0.0"),
        ({"norm_type": -math.inf}, "config key 'grad_clip.norm_type' must be > 0 .*, got -inf"),
        ({"norm_type": math.nan}, "config key 'grad_clip.norm_type' must be > 0 .*, got nan"),
        (
            {"on_nonfinite": "skipp"},
            "config key 'grad_clip.on_nonfinite' is 'skipp' \\(did you mean 'skip'\\?\\); "
            "choose one of skip, raise",
        ),
        ({"max_nrom": 1.0}, "unknown config key 'grad_clip.max_nrom' \\(did you mean 'max_norm'"),
    ],
)
def test_invalid_values_name_the_key(values, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        section(**values)
