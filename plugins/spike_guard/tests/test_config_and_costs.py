"""spike_guard: one-line config errors, and no host sync on a non-logging step."""

from __future__ import annotations

import logging

import pytest
from plugtrain_spike_guard import SpikeGuard

from plugtrain.plugin import ConfigError, PluginError, RunControl, SkipRange
from plugtrain.testing import assert_costs, count_costs, setup_context

ENABLE = ("--plugins.enabled", "spike_guard")
NO_REWIND = ("--spike_guard.max_consecutive", "0")


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("window", "1", "config key 'spike_guard.window' must be >= 2, got 1"),
        ("sigma", "0", "config key 'spike_guard.sigma' must be > 0, got 0.0"),
        ("signals", "loss,norm", "config key 'spike_guard.signals' must be a non-empty list of"),
        (
            "rewind_sigma",
            "3",
            "'spike_guard.rewind_sigma' must be 0 (off) or > sigma = 6.0",
        ),
    ],
)
def test_a_bad_value_is_a_one_line_error(key, value, message):
    with pytest.raises(ConfigError) as e:
        setup_context({}, *ENABLE, f"--spike_guard.{key}", value)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_rewinding_without_checkpoints_is_a_one_line_error():
    guard = SpikeGuard()
    ctx = setup_context({"spike_guard": guard}, *ENABLE)
    with pytest.raises(PluginError, match=r"checkpoint\.enable is off: enable checkpoints") as e:
        guard.setup(ctx)
    assert "\n" not in str(e.value)
    ctx = setup_context({"spike_guard": guard}, *ENABLE, "--spike_guard.max_consecutive", "0")
    guard.setup(ctx)  # skipping alone needs no checkpoint


def test_a_run_within_the_warmup_is_one_warning_at_start(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("plugtrain"), "propagate", True)

    def warnings(steps: int, warmup: int) -> list[str]:
        caplog.clear()
        guard = SpikeGuard()
        args = ("--training.steps", str(steps), "--spike_guard.warmup_steps", str(warmup))
        guard.setup(setup_context({"spike_guard": guard}, *ENABLE, *NO_REWIND, *args))
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    assert warnings(40, 100) == [
        "spike_guard: no step is tested for spikes within training.steps = 40 (the tests start "
        "after 100 accepted steps; non-finite values are still skipped): lower "
        "spike_guard.warmup_steps"
    ]
    assert warnings(40, 40) != []
    assert warnings(2, 0) != []  # the window needs 2 values
    assert warnings(41, 40) == warnings(3, 0) == []


def test_no_host_sync_per_step_with_grad_clip_and_the_fp16_scaler(tmp_path):
    costs = count_costs(
        tmp_path,
        "--plugins.enabled", "spike_guard,grad_clip,grad_scaler",
        "--training.mixed_precision_param", "float16",
        "--checkpoint.enable", "true", "--checkpoint.async_mode", "disabled",
    )  # fmt: skip
    assert_costs(costs, syncs=0)


def test_a_rewind_past_max_rewinds_ends_the_run_with_one_line():
    guard, control = SpikeGuard(), RunControl()
    control.skip_ranges += [SkipRange(i, i, "spike_guard") for i in (1, 2, 3)]
    with pytest.raises(PluginError, match=r"after 3 rewinds already \(spike_guard.max_rewinds\)"):
        guard._rewind(12, 11, 11, 10, "spike", control)
    assert control.requested_rewind is None
    control.skip_ranges.pop()
    guard._rewind(12, 11, 11, 10, "spike", control)
    assert control.requested_rewind is not None
    assert (control.requested_rewind.to_step, control.requested_rewind.through_batch) == (-90, 11)
