"""Checkpoints in one process: exact resume, SIGTERM, atomic saves, pruning and refusals."""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from plugtrain.checkpoint.dcp_io import flat_keys, read_checkpoint, to_tensors
from plugtrain.checkpoint.faults import FAULT_ENV
from plugtrain.checkpoint.layout import complete_checkpoints
from plugtrain.errors import CheckpointError, ConfigError
from plugtrain.observability.metrics import truncate_metrics
from plugtrain.plugin import SetupContext, StepContext, full_tensor, hookimpl
from plugtrain.testing import (
    SigtermAt,
    make_trainer,
    read_metrics,
    run_distributed,
    run_script,
    tiny_args,
)
from plugtrain.training.launch import configure, run_cli
from plugtrain.training.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # in-process trainers

# -- the scenarios, run in-process (a world of one) or on each rank by run_distributed --

K = 4
"""Steps before the interruption; every scenario trains 2K steps in all."""


class StepCounter:
    """A stateful plugin: counts steps in a Python int and sums them in a tensor."""

    def __init__(self) -> None:
        self.count = 0
        self.total = torch.zeros((), dtype=torch.float64)
        self.loaded: list[dict] = []

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        self.count += 1
        self.total += ctx.step

    @hookimpl
    def state_dict(self) -> dict:
        return {"count": self.count, "nested": {"total": self.total}}

    @hookimpl
    def load_state_dict(self, state_dict: dict) -> None:
        self.count, self.total = state_dict["count"], state_dict["nested"]["total"]
        self.loaded.append({"count": self.count, "total": self.total.item()})


class Stateless:
    """Implements load_state_dict but saves nothing: it must never be asked to load."""

    def __init__(self) -> None:
        self.loaded = 0

    @hookimpl
    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded += 1


class Dormant:
    """Has state but deactivates itself in setup: it must contribute nothing."""

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        ctx.deactivate(self, "dormant: nothing to do")

    @hookimpl
    def state_dict(self) -> dict:
        raise AssertionError("a deactivated plugin's state_dict was called")


def full_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded (collective), by name."""
    return {n: full_tensor(p.detach()).clone() for n, p in trainer.model.named_parameters()}


def build(dump_folder: Path, *args: str, plugins: dict | None = None) -> Trainer:
    return make_trainer(dump_folder, *args, steps=2 * K, plugins=list((plugins or {}).items()))


def sigterm_scenario(
    root: str, dtype: str, async_mode: str, sigterm_rank: int, extra: tuple[str, ...] = ()
) -> dict:
    """Train 2K steps straight (no checkpoints), then K steps stopped by a SIGTERM that only
    rank ``sigterm_rank`` gets mid-step, then resume to 2K; ``extra`` arguments go to every
    run. Rank 0 returns what to compare: beyond the kit's ``interrupted_and_resumed``, the
    checkpoints saved and the plugin states loaded."""
    torch.set_num_threads(1)
    root_path = Path(root) / f"{dtype}-{async_mode}"
    args = ["--training.mixed_precision_param", dtype, *extra]
    straight = build(root_path / "straight", *args, plugins={"counter": StepCounter()})
    straight.run()
    ckpt = [
        *args,
        "--checkpoint.enable", "true",
        "--checkpoint.interval", "3",  # due at 3 and 6 only: the stop at K is the SIGTERM's
        "--checkpoint.async_mode", async_mode,
    ]  # fmt: skip
    resumed_folder = root_path / "resumed"
    first = build(
        resumed_folder,
        *ckpt,
        plugins={"counter": StepCounter(), "sigterm": SigtermAt(K, sigterm_rank)},
    )
    first.run()
    saved_after_stop = sorted(p.name for p in (resumed_folder / "checkpoints").iterdir())
    plugins = {"counter": StepCounter(), "stateless": Stateless(), "dormant": Dormant()}
    second = build(resumed_folder, *ckpt, plugins=plugins)
    step_at_resume = second.step
    second.run()
    result = {
        "stopped_at": first.step,
        "saved_after_stop": saved_after_stop,
        "step_at_resume": step_at_resume,
        "counter_loaded": plugins["counter"].loaded,
        "counter_final": plugins["counter"].count,
        "stateless_loaded": plugins["stateless"].loaded,
        "straight_params": full_parameters(straight),
        "resumed_params": full_parameters(second),
        "rank": second.parallel_dims.rank,
    }
    if second.parallel_dims.is_main:
        result["straight_records"] = read_metrics(root_path / "straight")
        result["resumed_records"] = read_metrics(resumed_folder)
    return result


TWO_RANK_SCENARIOS = [("float32", "disabled"), ("bfloat16", "async"), ("float16", "disabled")]


def two_rank_scenarios(root: str) -> list[dict]:
    """:func:`sigterm_scenario` for each of TWO_RANK_SCENARIOS, SIGTERM on rank 1 only."""
    return [sigterm_scenario(root, d, m, 1) for d, m in TWO_RANK_SCENARIOS]


CKPT = ("--checkpoint.enable", "true", "--checkpoint.interval", "2")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """An uninterrupted fp32 run of 2K steps without checkpoints: records and parameters."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        folder = tmp_path_factory.mktemp("reference")
        trainer = build(folder)
        trainer.run()
        return {"records": read_metrics(folder), "params": full_parameters(trainer)}
    finally:
        torch.set_num_threads(threads)


def steps_losses(records: list[dict], *metrics: str) -> list[tuple]:
    """What a resumed run must reproduce of each step: loss, LR and the named metrics."""
    return [
        (r["step"], r["loss"], r["lr"], *(r[m] for m in metrics)) for r in records if "loss" in r
    ]


def assert_same_parameters(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    different = [k for k in got if not torch.equal(got[k], expected[k])]
    assert not different, different


def model_tensors(path) -> dict:
    return {k.removeprefix("model."): v for k, v in read_checkpoint(path, "model.").items()}


@pytest.mark.parametrize(
    ("dtype", "async_mode", "attention"),
    [
        ("float32", "disabled", "causal"),
        ("bfloat16", "disabled", "causal"),
        ("float32", "async", "causal"),
        ("float32", "disabled", "document"),
    ],
)
def test_interrupted_run_resumes_exactly(tmp_path, dtype, async_mode, attention):
    handler = signal.getsignal(signal.SIGTERM)
    r = sigterm_scenario(str(tmp_path), dtype, async_mode, 0, ("--model.attention", attention))
    assert signal.getsignal(signal.SIGTERM) is handler  # given back at close
    assert r["stopped_at"] == K
    assert r["saved_after_stop"] == ["step-3", f"step-{K}"]
    assert r["step_at_resume"] == K
    assert steps_losses(r["resumed_records"]) == steps_losses(r["straight_records"])
    assert len(steps_losses(r["resumed_records"])) == 2 * K
    assert_same_parameters(r["resumed_params"], r["straight_params"])
    assert r["counter_loaded"] == [{"count": K, "total": sum(range(1, K + 1))}]
    assert r["counter_final"] == 2 * K
    assert r["stateless_loaded"] == 0


def test_a_save_before_the_first_optimizer_step_changes_nothing(tmp_path, reference):
    # Step 1 vetoed: AdamW has no state yet when step-1 is saved. get_state_dict fills it by
    # taking a zero-lr step, which would shift AdamW's step count for the rest of the run.
    veto = ["--plugins.enabled", "hook_recorder", "--hook_recorder.veto_steps", "[1]"]
    plain = build(tmp_path / "plain", *veto)
    plain.run()
    args = [*veto, *CKPT, "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0"]
    build(tmp_path / "saved", *args).run()
    expected = steps_losses(read_metrics(tmp_path / "plain"))
    assert expected != steps_losses(reference["records"])  # the veto matters
    assert steps_losses(read_metrics(tmp_path / "saved")) == expected
    resume_at_1 = ("--checkpoint.load_step", "1", "--checkpoint.discard_later", "true")
    resumed = build(tmp_path / "saved", *args, *resume_at_1)
    assert resumed.step == 1 and not resumed.optimizer.state
    resumed.run()
    assert steps_losses(read_metrics(tmp_path / "saved")) == expected
    assert_same_parameters(full_parameters(resumed), full_parameters(plain))


def test_resume_restores_rng_states(tmp_path):
    import random

    import numpy as np

    trainer = build(tmp_path, *CKPT, "--training.steps", "2")
    trainer.run()
    expected = torch.rand(3), random.random(), np.random.rand()
    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    build(tmp_path, *CKPT, "--training.steps", "2").close()
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]


def test_saves_on_schedule_and_keeps_the_latest_k(tmp_path):
    build(tmp_path, *CKPT, "--checkpoint.keep_latest_k", "2", "--training.steps", "7").run()
    folder = tmp_path / "checkpoints"
    assert sorted(os.listdir(folder)) == ["step-6", "step-7"]  # 2, 4, 6 by interval, 7 the last
    build(tmp_path, *CKPT, "--checkpoint.keep_latest_k", "0", "--training.steps", "8").run()
    assert list(complete_checkpoints(folder)) == [6, 7, 8]
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 9))


def test_crash_mid_save_resumes_from_the_previous_complete_checkpoint(
    tmp_path, reference, train_py
):
    # The crash: after writing its shard and DCP's .metadata, before the commit (rename).
    env = {FAULT_ENV: f"before_commit:{K}:0"}
    crashed = run_script(train_py, [*tiny_args(tmp_path, steps=2 * K), *CKPT], env=env)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    folder = tmp_path / "checkpoints"
    assert sorted(os.listdir(folder)) == ["step-2", f"step-{K}.partial"]
    assert (folder / f"step-{K}.partial" / ".metadata").is_file()  # looks complete to DCP
    resumed = build(tmp_path, *CKPT)
    assert resumed.step == 2
    resumed.run()
    assert sorted(os.listdir(folder)) == ["step-4", "step-6", "step-8"]  # the partial is gone
    assert steps_losses(read_metrics(tmp_path)) == steps_losses(reference["records"])
    assert_same_parameters(full_parameters(resumed), reference["params"])
    assert_same_parameters(model_tensors(folder / "step-8"), reference["params"])


def test_sigterm_saves_and_exits_zero(tmp_path, repo):
    args = [*tiny_args(tmp_path, steps=10_000), *CKPT, "--checkpoint.interval", "10000"]
    proc = subprocess.Popen(
        [sys.executable, str(repo / "train.py"), *args],
        stderr=subprocess.PIPE, text=True, cwd=repo,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if "step     3 |" in line:
            proc.send_signal(signal.SIGTERM)
            break
    lines += proc.stderr.readlines()
    assert proc.wait(timeout=60) == 0, "".join(lines)
    last = read_metrics(tmp_path)[-1]["step"]
    assert 3 <= last < 10_000
    assert list(complete_checkpoints(tmp_path / "checkpoints")) == [last]
    assert f"stopped after step {last} on SIGTERM" in "".join(lines)
    restarted = Trainer(*configure(args))
    restarted.close()
    assert restarted.step == last


def test_metrics_are_cut_back_to_the_resumed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": 1, "loss": 2.0}, {"step": 2, "validation_loss": 3.0}, {"step": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 4, "lo')
    assert truncate_metrics(path, 2) > 0
    assert read_metrics(tmp_path) == records[:2]
    for torn in ('{"step": 2, "lo', '{"step": 2}'):  # a torn or unfinished last line is cut
        path.write_text('{"step": 1}\n' + torn)
        truncate_metrics(path, 5)
        assert path.read_text() == '{"step": 1}\n'


# --------------------------------------------------------------------------- refusals


def saved_run(tmp_path, *args: str) -> Trainer:
    trainer = build(tmp_path, *CKPT, "--training.steps", "4", *args)
    trainer.run()
    return trainer


def resume_error(tmp_path, *args: str) -> str:
    with pytest.raises(CheckpointError) as info:
        build(tmp_path, *CKPT, *args)
    message = str(info.value)
    assert "\n" not in message
    return message


def run_records(folder) -> list[str]:
    return [(folder / name).read_text() for name in ("metrics.jsonl", "config.json", "run.json")]


def test_refuses_a_checkpoint_of_another_model_and_writes_nothing(tmp_path):
    saved_run(tmp_path)
    before = run_records(tmp_path)
    assert resume_error(tmp_path, "--model.flavor", "debug") == (
        f"checkpoint {tmp_path / 'checkpoints' / 'step-4'} was saved from another model: "
        "parameter 'layers.0.attention.wk.weight' has shape [16, 32] there and [128, 256] here; "
        "resume with the model.flavor and tokenizer it was trained with, or train in another "
        "job.dump_folder"
    )
    assert run_records(tmp_path) == before


def test_starting_afresh_over_checkpoints_is_refused_and_deletes_nothing(tmp_path, capsys):
    saved_run(tmp_path)
    before = run_records(tmp_path)
    assert resume_error(tmp_path, "--checkpoint.load_step", "0") == (
        f"checkpoint.load_step is 0 (start afresh), but {tmp_path / 'checkpoints'} holds "
        "checkpoints of an earlier run (steps 2, 4): train in another job.dump_folder, or add "
        "--checkpoint.discard_later true to delete them"
    )
    assert list(complete_checkpoints(tmp_path / "checkpoints")) == [2, 4]
    assert run_records(tmp_path) == before
    capsys.readouterr()
    discard = ("--checkpoint.load_step", "0", "--checkpoint.discard_later", "true")
    afresh = build(tmp_path, *CKPT, *discard)
    afresh.close()
    log = capsys.readouterr().err
    assert afresh.step == 0 and not complete_checkpoints(tmp_path / "checkpoints")
    assert "starting afresh (checkpoint.load_step 0)" in log
    assert "deleted step-2, step-4 (checkpoint.discard_later)" in log
    assert "no checkpoint to resume from" not in log


def test_resuming_before_later_checkpoints_is_refused_unless_discarded(tmp_path, capsys):
    saved_run(tmp_path, "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0")
    before = run_records(tmp_path)
    assert resume_error(tmp_path, "--checkpoint.load_step", "2") == (
        f"checkpoint.load_step is 2, but {tmp_path / 'checkpoints'} holds later checkpoints "
        "(steps 3, 4) that this run would overwrite: resume from the latest with "
        "--checkpoint.load_step -1, or add --checkpoint.discard_later true to delete them"
    )
    assert list(complete_checkpoints(tmp_path / "checkpoints")) == [1, 2, 3, 4]
    assert run_records(tmp_path) == before
    # A requeued job script that keeps its load_step: refused, never a silent deletion.
    requeued = ("--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0")
    assert "holds later checkpoints" in resume_error(
        tmp_path, *requeued, "--training.steps", "4", "--checkpoint.load_step", "3"
    )
    capsys.readouterr()
    discard = ("--checkpoint.load_step", "2", "--checkpoint.discard_later", "true")
    resumed = build(tmp_path, *CKPT, *requeued, "--training.steps", "4", *discard)
    assert resumed.step == 2
    assert "deleted step-3, step-4 (checkpoint.discard_later)" in capsys.readouterr().err
    resumed.run()
    assert list(complete_checkpoints(tmp_path / "checkpoints")) == [1, 2, 3, 4]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_a_save_never_replaces_a_complete_checkpoint(tmp_path):
    trainer = build(tmp_path, *CKPT, "--training.steps", "4")
    # Another run, writing to the same folder meanwhile, has saved the step this one will.
    foreign = tmp_path / "checkpoints" / "step-2"
    build(tmp_path / "other", *CKPT, "--training.steps", "2").run()
    shutil.copytree(tmp_path / "other" / "checkpoints" / "step-2", foreign)
    (foreign / "mark").touch()
    with pytest.raises(CheckpointError, match=r"cannot save \S+step-2: a complete checkpoint"):
        trainer.run()
    assert (foreign / "mark").is_file()


def test_a_resume_that_changes_a_fixed_setting_is_refused_and_writes_nothing(tmp_path):
    saved_run(tmp_path)
    step4 = tmp_path / "checkpoints" / "step-4"
    before = run_records(tmp_path), sorted(os.listdir(step4))
    assert resume_error(tmp_path, "--training.steps", "4", "--optimizer.lr", "1e-5") == (
        f"optimizer.lr is 1e-05 in this run but 0.003 in checkpoint {step4}, and a resumed run "
        "keeps the settings it started with: drop --optimizer.lr (or set it back), or start a "
        "new run in another job.dump_folder"
    )
    assert "data.shuffle is False in this run but True" in resume_error(
        tmp_path, "--data.shuffle", "false"
    )
    assert (run_records(tmp_path), sorted(os.listdir(step4))) == before


def test_extending_a_finished_run_keeps_its_lr_schedule_and_says_so(tmp_path, capsys):
    saved_run(tmp_path)
    planned = json.loads((tmp_path / "checkpoints" / "step-4" / "config.json").read_text())
    assert planned["training"]["steps"] == 4
    capsys.readouterr()
    build(tmp_path, *CKPT, "--training.steps", "6", "--job.description", "longer").run()
    lr = {r["step"]: r["lr"] for r in read_metrics(tmp_path)}
    assert list(lr) == [1, 2, 3, 4, 5, 6]
    assert lr[4] > lr[5] == lr[6] == pytest.approx(3e-3 * 0.1)  # decayed to the end, no jump
    assert (
        "training.steps is 6 but the resumed run's LR schedule was planned for 4 steps: steps "
        "5-6 train at the schedule's final learning rate, 0.0003 (min_lr_ratio x lr)"
    ) in capsys.readouterr().err
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["resumed_from"] == {"path": str(tmp_path / "checkpoints" / "step-4"), "step": 4}
    assert run["lr_schedule_steps"] == 4
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["training"]["steps"], config["job"]["description"]) == (6, "longer")


def test_refuses_a_load_step_that_does_not_exist(tmp_path):
    saved_run(tmp_path)
    assert resume_error(tmp_path, "--checkpoint.load_step", "3") == (
        f"checkpoint.load_step is 3, but {tmp_path / 'checkpoints'} has no complete checkpoint "
        "step-3 (complete ones: 2, 4): pick one of them, or -1 for the latest"
    )
    shutil.rmtree(tmp_path / "checkpoints")
    assert "(complete ones: none)" in resume_error(tmp_path, "--checkpoint.load_step", "4")


@pytest.mark.parametrize("damage", ["metadata", "shard", "truncated", "config"])
def test_refuses_a_damaged_checkpoint_and_keeps_it(tmp_path, damage):
    saved_run(tmp_path)
    step4 = tmp_path / "checkpoints" / "step-4"
    if damage == "metadata":
        (step4 / ".metadata").unlink()
    elif damage == "shard":
        (step4 / "__0_0.distcp").unlink()
    elif damage == "config":
        (step4 / "config.json").unlink()
    else:
        shard = step4 / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[:1000])
    before = sorted(os.listdir(step4)), (tmp_path / "metrics.jsonl").read_text()
    message = resume_error(tmp_path)
    assert message.startswith(f"checkpoint {step4} is damaged: ")
    assert message.endswith(
        "delete it to resume from the one before, or pick one with --checkpoint.load_step"
    )
    assert (sorted(os.listdir(step4)), (tmp_path / "metrics.jsonl").read_text()) == before
    assert list(complete_checkpoints(tmp_path / "checkpoints")) == [2, 4]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_never_unpickles_an_object(tmp_path):
    saved_run(tmp_path)
    step4 = tmp_path / "checkpoints" / "step-4"
    # A .metadata that would run code when unpickled.
    (step4 / ".metadata").write_bytes(pickle.dumps(os.system))
    assert "refusing to load 'posix.system'" in resume_error(tmp_path)
    # A checkpoint that stores a number as a pickled object, as plain DCP does.
    tensors = read_checkpoint(tmp_path / "checkpoints" / "step-2")
    config = (step4 / "config.json").read_bytes()  # what the run saves beside the tensors
    shutil.rmtree(step4)
    dcp.save({**tensors, "train.step": 4}, checkpoint_id=step4, no_dist=True)
    (step4 / "config.json").write_bytes(config)
    assert "stores 'train.step' as a pickled object, which plugtrain never loads" in (
        resume_error(tmp_path)
    )


def test_plugin_state_must_be_tensors_and_numbers():
    assert flat_keys(to_tensors({"a": [1, 2.5], "b": {"c": True, "d": None}})).keys() == {
        "a.0", "a.1", "b.c"
    }  # fmt: skip
    with pytest.raises(CheckpointError, match=r"cannot checkpoint 'plugins\.p\.name': it is a str"):
        to_tensors({"p": {"name": "x"}}, "plugins")


def test_refusal_through_train_py_is_one_line_and_exit_2(tmp_path, capsys):
    saved_run(tmp_path)
    capsys.readouterr()
    code = run_cli(lambda: Trainer(*configure([*tiny_args(tmp_path), *CKPT, "--model.flavor",
                                               "debug"])))  # fmt: skip
    assert code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("plugtrain: error: checkpoint ") and "another model" in line


# --------------------------------------------------------------------------- failed saves


def train_py_main(argv: list[str]) -> None:
    """What train.py's main does, in this process."""
    Trainer(*configure(argv)).run()


def save_failure(capsys, folder, argv: list[str]) -> str:
    """Run ``argv`` through run_cli; its one error line, once the failed save is checked."""
    capsys.readouterr()
    assert run_cli(lambda: train_py_main(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("plugtrain: error:")]
    checkpoints = folder / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["step-2"]  # intact; the partial step-4 is gone
    resumed = build(folder, *CKPT)
    resumed.close()
    assert resumed.step == 2
    return line


def failure_message(folder, cause: str) -> str:
    checkpoints = folder / "checkpoints"
    return (
        rf"plugtrain: error: cannot save checkpoint {re.escape(str(checkpoints / 'step-4'))}: "
        rf"{cause} \([\d.]+ MiB free in {re.escape(str(checkpoints))}\); the previous "
        r"checkpoints are intact: free space or set job\.dump_folder elsewhere"
    )


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_failed_save_is_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, capsys, monkeypatch, async_mode
):
    write_data = FileSystemWriter.write_data

    def disk_full_at_step_4(self, plan, planner):
        if Path(self.path).name != "step-4.partial":
            return write_data(self, plan, planner)
        shard = Path(self.path) / "__0_0.distcp"
        shard.write_bytes(b"half a shard")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(shard))

    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full_at_step_4)
    argv = [*tiny_args(tmp_path, steps=6), *CKPT, "--checkpoint.async_mode", async_mode]
    line = save_failure(capsys, tmp_path, argv)
    assert re.fullmatch(failure_message(tmp_path, "No space left on device"), line), line


@pytest.mark.slow
def test_a_full_disk_is_named_as_such(tmp_path, capsys):
    # torch's zip writer says "unexpected pos 704 vs 598" and nothing of the disk: a real one.
    folder = tmp_path / "small"
    folder.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(folder)],
                           capture_output=True)  # fmt: skip
    if mount.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr.decode().strip()}")
    try:  # a checkpoint takes 2 MiB: step-2 fits, step-4 does not
        line = save_failure(capsys, folder, [*tiny_args(folder, steps=6), *CKPT])
        assert re.fullmatch(failure_message(folder, "No space left on device"), line), line
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_config_is_validated():
    with pytest.raises(ConfigError, match=r"'checkpoint\.interval' must be >= 1, got 0"):
        configure(["--checkpoint.interval", "0"])
    with pytest.raises(ConfigError, match=r"'checkpoint\.load_step' needs checkpoint\.enable"):
        configure(["--checkpoint.load_step", "4"])
    with pytest.raises(ConfigError, match=r"'checkpoint\.async_mode' is 'asink' \(did you mean"):
        configure(["--checkpoint.async_mode", "asink"])


# -- on two processes: exact resume, SIGTERM on one rank, resharding 2 -> 1, kill -9 --


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """Each scenario's results on both ranks, by (dtype, async_mode)."""
    root = tmp_path_factory.mktemp("two_ranks")
    per_rank = run_distributed(two_rank_scenarios, 2, str(root))
    return {
        scenario: [results[i] for results in per_rank]
        for i, scenario in enumerate(TWO_RANK_SCENARIOS)
    } | {"root": root}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", TWO_RANK_SCENARIOS, ids="-".join)
def test_two_processes_resume_exactly_after_sigterm_on_one_rank(two_ranks, scenario):
    ranks = two_ranks[scenario]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["stopped_at"] == K and r["step_at_resume"] == K, r["rank"]
        assert r["saved_after_stop"] == ["step-3", f"step-{K}"]
        assert_same_parameters(r["resumed_params"], r["straight_params"])
        assert r["counter_loaded"] == [{"count": K, "total": sum(range(1, K + 1))}]
        assert r["counter_final"] == 2 * K and r["stateless_loaded"] == 0
    main = ranks[0]
    assert steps_losses(main["resumed_records"]) == steps_losses(main["straight_records"])
    assert len(steps_losses(main["resumed_records"])) == 2 * K


@pytest.mark.slow
def test_a_two_process_checkpoint_resumes_on_one(two_ranks, tmp_path):
    two = two_ranks[("float32", "disabled")][0]
    source = two_ranks["root"] / "float32-disabled" / "resumed" / "checkpoints" / f"step-{K}"
    shutil.copytree(source, tmp_path / "checkpoints" / f"step-{K}")
    trainer = build(tmp_path, *CKPT)
    assert trainer.step == K
    loaded = full_parameters(trainer)
    assert_same_parameters(loaded, model_tensors(source))  # resharded bit for bit
    trainer.run()
    got = read_metrics(tmp_path)
    expected = [r for r in two["straight_records"] if r["step"] > K]
    assert (
        [r["step"] for r in got] == [r["step"] for r in expected] == list(range(K + 1, 2 * K + 1))
    )
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in expected], rel=1e-5)
    assert [r["lr"] for r in got] == [r["lr"] for r in expected]


@pytest.mark.slow
def test_torchrun_restarts_after_kill_9_and_finishes_like_an_uninterrupted_run(
    two_ranks, tmp_path, train_py
):
    # Two crashes, each once: rank 1 dies while saving step 4 (its shard and DCP's metadata
    # written, the checkpoint not yet committed), then rank 0 dies after step 5.
    markers = tmp_path / "saving-killed", tmp_path / "step-killed"
    faults = f"before_commit:{K}:1:{markers[0]},after_step:{K + 1}:0:{markers[1]}"
    run = tmp_path / "run"
    result = run_script(
        train_py,
        [*tiny_args(run, steps=2 * K), *CKPT],
        nproc=2,
        # NOTE: torch 2.13's agent keeps its rendezvous store across restarts, and restarted
        # workers then read the dead ones' gloo addresses from it and hang (pytorch#135712).
        env={FAULT_ENV: faults, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        torchrun_args=("--standalone", "--max-restarts=2"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(m.exists() for m in markers)
    resumed = re.findall(r"resumed from \S+/(step-\d+) ", result.stderr)
    assert resumed == ["step-2", f"step-{K}"]  # the half-saved step 4 was never loaded
    straight = two_ranks[("float32", "disabled")][0]
    assert steps_losses(read_metrics(run)) == steps_losses(straight["straight_records"])
    checkpoints = sorted(os.listdir(run / "checkpoints"))
    assert checkpoints == [f"step-{s}" for s in (K, K + 2, 2 * K)]
    final = run / "checkpoints" / f"step-{2 * K}"
    assert_same_parameters(model_tensors(final), straight["straight_params"])
