"""ema: its config, the average against a reference on the unsharded model, its costs,
resuming, and validation on the averaged weights against the exported ones."""

from __future__ import annotations

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
SCHEDULE = ("--ema.decay", "0.7", "--ema.start_step", "1", "--ema.every_n_steps", "2")
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


class ReferenceEma:
    """The reference: the average computed on the unsharded parameters (gathered here) with
    the host-side schedule, skipping vetoed steps by reading the flag."""

    def __init__(self, decay: float, start_step: int, every: int) -> None:
        self.decay, self.start_step, self.every = decay, start_step, every
        self.average: dict[str, torch.Tensor] = {}
        self.params: dict = {}

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.params = dict(ctx.model.named_parameters())
        self.average = {n: full(p.detach()).clone() for n, p in self.params.items()}

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        if bool(ctx.skipped) or (ctx.step > self.start_step and ctx.step % self.every):
            return
        share = 1.0 if ctx.step <= self.start_step else 1 - self.decay
        for name, p in self.params.items():
            self.average[name] = torch.lerp(self.average[name], full(p.detach()), share)


def averages_against_the_reference(folder: str) -> dict:
    """Run on each rank (or in-process): 6 steps, step 4 vetoed; the plugin's averages
    gathered, and the reference's."""
    torch.set_num_threads(1)
    ema, reference = Ema(), ReferenceEma(0.7, 1, 2)
    trainer = make_trainer(
        folder, "--plugins.enabled", "ema,hook_recorder", *SCHEDULE,
        "--hook_recorder.veto_steps", "[4]",
        steps=6, plugins=[(NAME, ema), ("reference", reference)],
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
    assert set(record) == {"step", "validation_loss", "ema/validation_loss"}
    assert record["ema/validation_loss"] != record["validation_loss"]
    export = tmp_path / "run" / "checkpoints" / "step-3" / "ema"
    assert (export / ".metadata").is_file()

    fresh = make_trainer(tmp_path / "fresh", *VALIDATION, steps=3)
    load_exported(fresh.model, export)
    ema = trainer.host.get(NAME)
    for p, (name, average) in zip(fresh.model.parameters(), ema.average.items(), strict=True):
        assert torch.equal(full(p.detach()), full(average)), name
    assert fresh.validate() == {"validation_loss": record["ema/validation_loss"]}
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
