"""The plugin's config, activation rule, scale dynamics, metrics and checkpoint state."""

from __future__ import annotations

import re

import pytest
import torch
from plugtrain_grad_scaler import GradScalerConfig

from plugtrain.plugin import ConfigError
from plugtrain.testing import InjectInf, Trainer, make_trainer, read_metrics, setup_context

ENABLE = ("--plugins.enabled", "grad_scaler")
FP16 = ("--training.mixed_precision_param", "float16")


def section(**values) -> GradScalerConfig:
    """The [grad_scaler] section a run validates from ``values``, as TOML gives them."""
    plugin = object()
    ctx = setup_context({"grad_scaler": plugin}, *ENABLE, values={"grad_scaler": values})
    return ctx.plugin_config(plugin)


def test_enabled_accepts_toml_booleans_command_line_strings_and_auto():
    assert section().enabled == "auto"
    assert section(enabled=True).enabled is True  # TOML true
    assert section(enabled=False).enabled is False
    assert section(enabled="false").enabled is False  # --grad_scaler.enabled false
    assert section(enabled="auto").enabled == "auto"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"enabled": "maybe"}, "'grad_scaler.enabled' must be bool or 'auto', got 'maybe'"),
        ({"init_scale": 0}, "'grad_scaler.init_scale' must be finite and > 0, got 0.0"),
        ({"init_scale": "inf"}, "'grad_scaler.init_scale' must be finite and > 0, got inf"),
        ({"growth_factor": 1}, "'grad_scaler.growth_factor' must be finite and > 1, got 1.0"),
        ({"backoff_factor": 1}, "'grad_scaler.backoff_factor' must be in (0, 1), got 1.0"),
        ({"backoff_factor": 0}, "'grad_scaler.backoff_factor' must be in (0, 1), got 0.0"),
        ({"growth_interval": 0}, "'grad_scaler.growth_interval' must be >= 1, got 0"),
    ],
)  # fmt: skip
def test_bad_values_name_the_key(values, message):
    with pytest.raises(ConfigError, match="^config key " + re.escape(message)):
        section(**values)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_enabled_true_without_float16_is_a_clear_error(tmp_path, dtype):
    with pytest.raises(ConfigError) as err:
        make_trainer(
            tmp_path, "--training.mixed_precision_param", dtype, *ENABLE,
            "--grad_scaler.enabled", "true",
        )  # fmt: skip
    assert str(err.value) == (
        f"config key 'grad_scaler.enabled' is true but training.mixed_precision_param is "
        f"{dtype}: loss scaling is for float16 only ({dtype} has float32's exponent range and "
        f'needs none); set grad_scaler.enabled = "auto" or false'
    )


@pytest.mark.parametrize(("enabled", "active"), [("auto", True), ("true", True), ("false", False)])
def test_float16_activation_and_the_missing_scaler_warning(tmp_path, recwarn, enabled, active):
    trainer = make_trainer(tmp_path, *FP16, *ENABLE, "--grad_scaler.enabled", enabled)
    assert ("grad_scaler" in trainer.host.names()) is active
    warned = [w for w in recwarn if "no enabled plugin scales the loss" in str(w.message)]
    assert bool(warned) is not active


def run_with_infs(tmp_path, *args: str, steps: int, inf_steps=()) -> tuple[Trainer, list]:
    trainer = make_trainer(
        tmp_path, *FP16, *ENABLE, *args, steps=steps,
        plugins=[("inject", InjectInf(inf_steps))],
    )  # fmt: skip
    trainer.run()
    return trainer, read_metrics(tmp_path)


GROWTH = (
    "--grad_scaler.init_scale", "1024", "--grad_scaler.growth_interval", "2",
    "--grad_scaler.growth_factor", "4", "--grad_scaler.backoff_factor", "0.25",
)  # fmt: skip


def test_scale_grows_after_growth_interval_clean_steps_and_backs_off_on_each_inf(tmp_path, capsys):
    trainer, records = run_with_infs(tmp_path, *GROWTH, steps=6, inf_steps={3, 4})
    assert [r["grad_scaler/loss_scale"] for r in records] == [1024, 4096, 1024, 256, 256, 1024]
    assert [r["grad_scaler/skipped_steps"] for r in records] == [0, 0, 1, 2, 2, 2]
    # The core counts the skips by the plugin that vetoed, read on logging steps only.
    assert [r["skipped_steps.grad_scaler"] for r in records] == [0, 0, 1, 2, 2, 2]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 2, 2, 2]
    assert int(trainer.lr_scheduler.applied_steps) == 4  # skipped steps keep the schedule
    log = capsys.readouterr().err
    assert "| skipped 2 (grad_scaler 2)" in log
    assert "step 3 skipped" not in log  # a device veto has no per-step line: no host read


def test_state_dict_round_trip_restores_scale_and_growth_tracker(tmp_path):
    first, records = run_with_infs(tmp_path / "a", *GROWTH, steps=5, inf_steps={3, 4})
    assert records[-1]["grad_scaler/loss_scale"] == 256  # one clean step since the backoff
    state = first.host.results("state_dict")["grad_scaler"]
    assert state == {
        "scale": torch.tensor(256.0),
        "growth_tracker": torch.tensor(1),
        "skipped_steps": torch.tensor(2),
    }
    assert all(isinstance(v, torch.Tensor) for v in state.values())  # no pickled objects

    resumed = make_trainer(tmp_path / "b", *FP16, *ENABLE, *GROWTH, steps=1)
    plugin = resumed.host.get("grad_scaler")
    plugin.load_state_dict(state)
    assert plugin.state_dict() == state
    assert plugin.skipped_steps == 2
    resumed.run()
    # The restored tracker makes the first clean step the second of the interval: growth.
    assert read_metrics(tmp_path / "b")[-1]["grad_scaler/loss_scale"] == 256 * 4


def test_resume_of_a_bfloat16_checkpoint_into_float16_starts_at_init_scale(tmp_path):
    bf16 = make_trainer(
        tmp_path / "bf16", "--training.mixed_precision_param", "bfloat16", *ENABLE, steps=1
    )
    assert "grad_scaler" not in bf16.host.results("state_dict")  # nothing saved
    fp16 = make_trainer(
        tmp_path / "fp16", *FP16, *ENABLE, "--grad_scaler.init_scale", "512", steps=1
    )
    fp16.host.get("grad_scaler").load_state_dict({})  # tolerated all the same
    fp16.run()
    assert read_metrics(tmp_path / "fp16")[-1]["grad_scaler/loss_scale"] == 512
