"""ema: its config, the average against a reference on the unsharded model, its costs,
resuming, and validation on the averaged weights against the exported ones."""

from __future__ import annotations

import logging

import pytest
import torch
from plugtrain_ema import Ema, load_exported
from torch.distributed.tensor import DTensor

from plugtrain.plugin import ConfigError, SetupContext, StepContext, hookimpl
from plugtrain.testing import (
    SAMPLE,
    assert_costs,
    count_costs,
    interrupted_and_resumed,
    make_trainer,
    read_metrics,
    run_distributed,
    setup_context,
)

NAME = "ema"
ENABLED = ("--plugins.enabled", NAME)
SCHEDULE = ("--ema.decay", "0.2", "--ema.start_step", "1", "--ema.every_n_steps", "2")
VALIDATION = ("--validation.interval", "3", "--validation.steps", "1",
              "--data.validation_path", str(SAMPLE / "validation.jsonl"))  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--ema.decay", "0.9", "--ema.half_life", "10"), "'ema.decay' is 0.9 and half_life is"),
        (("--ema.decay", "1"), "'ema.decay' must be in \\[0, 1\\), got 1"),
        (("--ema.half_life", "0"), "'ema.half_life' must be a finite number of steps > 0"),
        (("--ema.every_n_steps", "0"), "'ema.every_n_steps' must be >= 1, got 0"),
        (("--ema.start_step", "-1"), "'ema.start_step' must be >= 0, got -1"),
    ],
)
def test_a_bad_config_is_a_one_line_error_naming_the_key(args, message):
    with pytest.raises(ConfigError, match=f"config key {message}") as error:
        setup_context({}, *ENABLED, *args)
    assert "\n" not in str(error.value)


def test_half_life_sets_the_decay_per_update():
    plugin = Ema()
    plugin.setup(setup_context({NAME: plugin}, *ENABLED, "--ema.half_life", "8",
                               "--ema.every_n_steps", "2"))  # fmt: skip
    assert plugin.config.update_decay() == 0.5**0.25  # halves in 4 updates of 2 steps


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def test_the_decay_warms_up_per_update_after_start_step():
    def weights(*args: str) -> list[float | None]:
        plugin = Ema()
        plugin.setup(setup_context({NAME: plugin}, *ENABLED, "--ema.decay", "0.2", *args))
        return [plugin.config.update_weight(step) for step in range(1, 9)]

    every_2 = ("--ema.start_step", "1", "--ema.every_n_steps", "2")
    # Updates at steps 2, 4, 6, 8 are the t = 0, 1, 2, 3-th: decay min(0.2, (1 + t) / (10 + t)).
    assert weights(*every_2) == [1.0, 1 - 1 / 10, None, 1 - 2 / 11, None, 0.8, None, 0.8]
    assert weights(*every_2, "--ema.warmup", "false") == [1.0, 0.8, None, 0.8, None, 0.8, None, 0.8]


def test_a_run_too_short_to_average_is_one_warning_at_start(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("plugtrain"), "propagate", True)

    def warnings(steps: int, *args: str) -> list[str]:
        caplog.clear()
        plugin = Ema()
        plugin.setup(setup_context({NAME: plugin}, *ENABLED, "--training.steps", str(steps), *args))
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    assert warnings(40, "--ema.start_step", "40") == [
        "ema: no update step within training.steps = 40 (start_step 40, every_n_steps 1): the "
        "average stays a copy of the weights"
    ]
    assert warnings(41, "--ema.start_step", "40") == []
    assert warnings(40, "--ema.start_step", "30", "--ema.every_n_steps", "25") != []  # at 50
    no_warmup = ("--ema.decay", "0.99", "--ema.warmup", "false")
    assert warnings(40, *no_warmup) == [
        "ema: decay 0.99 averages over ~100 updates but the run has 40: the average stays close "
        "to the initial weights; set warmup = true or a lower decay"
    ]
    assert warnings(100, *no_warmup) == []
    assert warnings(40) == []  # the default decay, warmed up


class ReferenceEma:
    """The reference: the average computed on the unsharded parameters (gathered here) with
    the host-side schedule and decay warmup, skipping vetoed steps by reading the flag."""

    def __init__(self, decay: float, start_step: int, every: int) -> None:
        self.decay, self.start_step, self.every = decay, start_step, every
        self.average: dict[str, torch.Tensor] = {}
        self.params: dict = {}
        self.updates = 0
        """Update steps so far, vetoed ones included (the warmup's ``t``)."""

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.params = dict(ctx.model.named_parameters())
        self.average = {n: full(p.detach()).clone() for n, p in self.params.items()}

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        if ctx.step > self.start_step and ctx.step % self.every:
            return
        share = 1.0
        if ctx.step > self.start_step:
            share = 1 - min(self.decay, (1 + self.updates) / (10 + self.updates))
            self.updates += 1
        if bool(ctx.skipped):
            return
        for name, p in self.params.items():
            self.average[name] = torch.lerp(self.average[name], full(p.detach()), share)


def averages_against_the_reference(folder: str) -> dict:
    """Run on each rank (or in-process): 8 steps, step 4 vetoed; the plugin's averages
    gathered, and the reference's (the decay 0.2 is reached at the fourth update, step 8)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _averages_against_the_reference(folder)
    finally:
        torch.set_num_threads(threads)  # in-process, later tests must get the default back


def _averages_against_the_reference(folder: str) -> dict:
    ema, reference = Ema(), ReferenceEma(0.2, 1, 2)
    trainer = make_trainer(
        folder, "--plugins.enabled", "ema,hook_recorder", *SCHEDULE,
        "--hook_recorder.veto_steps", "[4]",
        steps=8, plugins=[(NAME, ema), ("reference", reference)],
    )  # fmt: skip
    trainer.run()
    # Shaped like the parameters: DTensors with their placements where the model is sharded
    # (any two processes), plain tensors where it is not (one float32 process).
    for average, param in zip(ema.average.values(), ema.params, strict=True):
        assert type(average) is type(param.data)
        if isinstance(param, DTensor):
            assert average.placements == param.placements
    gathered = {n: full(a) for n, a in ema.average.items()}
    params = {n: full(p.detach()) for n, p in reference.params.items()}
    return {"plugin": gathered, "reference": reference.average, "params": params}


def assert_bitwise_equal_to_the_reference(result: dict) -> None:
    assert result["plugin"].keys() == result["reference"].keys()
    for name, average in result["plugin"].items():
        assert average.dtype == torch.float32
        assert torch.equal(average, result["reference"][name]), name
        assert not torch.equal(average, result["params"][name]), name  # it does average


def test_the_average_is_the_reference_on_one_process(tmp_path):
    assert_bitwise_equal_to_the_reference(averages_against_the_reference(str(tmp_path)))


def on_two_ranks(folder: str) -> dict:
    result = averages_against_the_reference(f"{folder}/reference")
    costs = count_costs(f"{folder}/costs", *ENABLED, *SCHEDULE, plugin=NAME)
    return {**result, "costs": costs}


@pytest.mark.slow
def test_on_two_processes_the_sharded_average_is_the_reference_and_costs_nothing(tmp_path):
    for result in run_distributed(on_two_ranks, 2, str(tmp_path)):
        assert_bitwise_equal_to_the_reference(result)
        assert_costs(result["costs"], syncs=0, collectives={})


def test_no_host_sync_and_no_collective_per_step(tmp_path):
    costs = count_costs(tmp_path, *ENABLED, "--ema.every_n_steps", "1", plugin=NAME)
    print(f"ema: {costs.ms:.3f} ms per step in its hooks")
    assert_costs(costs, syncs=0, collectives={})


def test_a_resumed_run_continues_the_average_exactly(tmp_path):
    made: list[Ema] = []

    def plugins():
        made.append(Ema())
        return [(NAME, made[-1])]

    result = interrupted_and_resumed(tmp_path, *ENABLED, *SCHEDULE, steps=6, stop_after=3,
                                     plugins=plugins)  # fmt: skip
    assert result["stopped_at"] == result["step_at_resume"] == 3
    straight, resumed = made[0], made[2]
    assert resumed.step == straight.step == 6
    for name, average in straight.average.items():
        assert torch.equal(resumed.average[name], average), name


def test_validation_on_the_average_equals_a_model_loaded_from_the_export(tmp_path):
    checkpoints = ("--checkpoint.enable", "true", "--checkpoint.interval", "3")
    trainer = make_trainer(tmp_path / "run", *ENABLED, *SCHEDULE, *VALIDATION, *checkpoints,
                           steps=3)  # fmt: skip
    trainer.run()
    [record] = [r for r in read_metrics(tmp_path / "run") if "validation_loss" in r]
    keys = {"validation_loss", "validation_bpb"}
    assert set(record) == {"step", *keys, *(f"ema/{k}" for k in keys)}
    assert record["ema/validation_loss"] != record["validation_loss"]
    export = tmp_path / "run" / "checkpoints" / "step-3" / "ema"
    assert (export / ".metadata").is_file()

    fresh = make_trainer(tmp_path / "fresh", *VALIDATION, steps=3)
    load_exported(fresh.model, export)
    ema = trainer.host.get(NAME)
    for p, (name, average) in zip(fresh.model.parameters(), ema.average.items(), strict=True):
        assert torch.equal(full(p.detach()), full(average)), name
    assert fresh.validate() == {k: record[f"ema/{k}"] for k in keys}
    fresh.close()


def test_after_an_async_save_the_export_holds_the_average_of_its_step(tmp_path):
    """An async save completes a step or more later: the export must not take the live
    average, which has moved on since."""
    exports = {}
    for mode in ("disabled", "async"):
        args = ("--checkpoint.enable", "true", "--checkpoint.interval", "2",
                "--checkpoint.async_mode", mode)  # fmt: skip
        trainer = make_trainer(tmp_path / mode, *ENABLED, "--ema.decay", "0.5", *args, steps=4)
        trainer.run()
        exports[mode] = {s: tmp_path / mode / "checkpoints" / f"step-{s}" / NAME for s in (2, 4)}
    fresh = make_trainer(tmp_path / "fresh")
    loaded = {}
    for mode, folders in exports.items():
        for step, folder in folders.items():
            load_exported(fresh.model, folder)
            loaded[mode, step] = [full(p.detach()).clone() for p in fresh.model.parameters()]
    fresh.close()
    for step in (2, 4):
        assert all(map(torch.equal, loaded["async", step], loaded["disabled", step])), step
    assert not all(map(torch.equal, loaded["async", 2], loaded["async", 4]))
