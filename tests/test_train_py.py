"""train.py as a user runs it: exit codes and one-line errors.

One run starts the script itself; the others call what it runs
(``plugtrain.commands.train.train``, whose status it exits with) in this process, which saves a
Python and torch start-up each.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from plugtrain_grad_clip import GradClipConfig
from plugtrain_grad_scaler import GradScalerConfig
from plugtrain_hook_recorder import HookRecorderConfig

from plugtrain import sample
from plugtrain.commands.train import train
from plugtrain.config import JobConfig
from plugtrain.errors import ConfigError
from plugtrain.host.plugin_host import installed_plugins
from plugtrain.testing import SAMPLE, read_metrics, run_script, tiny_args
from plugtrain.training.launch import configure, run_cli
from plugtrain.training.launcher import exit_status, split_launch_options
from plugtrain.training.trainer import Trainer

VALIDATION = SAMPLE / "validation.jsonl"


def test_short_run_writes_metrics_and_exits_zero(tmp_path, train_py):
    result = run_script(train_py, tiny_args(tmp_path, steps=2))
    assert result.returncode == 0, result.stderr
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert "step     2 | loss" in result.stderr


def as_train_py(argv: list[str], capsys) -> tuple[int, str, str]:
    """What ``python train.py *argv`` does, in this process: its exit status, stdout, stderr."""
    capsys.readouterr()
    status = train(argv)
    out, err = capsys.readouterr()
    return status, out, err


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    status, _, err = as_train_py([*tiny_args(tmp_path), "--training.stepz", "3"], capsys)
    assert status == 2
    assert err.strip().splitlines() == [
        "plugtrain: error: unknown config key 'training.stepz' (did you mean 'steps'?); "
        "[training] has: batch_size, device, grad_accum_steps, mixed_precision_param, "
        "mixed_precision_reduce, seed, seq_len, steps"
    ]
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_bad_value_for_two_processes_is_one_line_and_exit_2(tmp_path, train_py, capfd):
    """--nproc-per-node checks the config before it starts any process; torchrun cannot.
    (The same command with good values trains on two processes: test_run_info.py's
    test_two_processes_say_it_once_with_their_layout_and_leave_a_checkpoint.)"""
    dump = tmp_path / "run"
    two = ["--nproc-per-node", "2"]
    for bad, line in [
        (("--training.steps", "0"), "config key 'training.steps' must be >= 1, got 0"),
        (("--parallelism.tp", "3"), "parallelism.tp = 3 does not divide the world size 2: "),
    ]:
        # capfd: a process started by mistake would print through the same descriptors.
        status, out, err = as_train_py([*two, *tiny_args(dump), *bad], capfd)
        assert (status, out) == (2, ""), err
        (said,) = err.splitlines()
        assert said.startswith(f"plugtrain: error: {line}")
        assert not dump.exists()
    # Under torchrun a rank exits 2 and rank 0 alone says why (the world size is checked before
    # the process group is up; torchrun may stop the other rank first), but torchrun exits 1
    # with a report of its own: what --nproc-per-node is for.
    under_torchrun = run_script(train_py, [*tiny_args(dump), "--parallelism.tp", "3"], nproc=2)
    assert under_torchrun.returncode == 1
    assert under_torchrun.stderr.count("plugtrain: error: ") == 1  # no "[rank 1] plugtrain:"
    assert "exitcode  : 2" in under_torchrun.stderr


def test_torchrun_options_go_to_the_launcher_and_the_rest_to_the_run():
    argv = ["--nproc_per_node=2", "--training.steps", "3", "--standalone", "--nnodes", "1"]
    assert split_launch_options(argv) == (
        ["--nproc_per_node=2", "--standalone", "--nnodes", "1"],
        ["--training.steps", "3"],
    )
    assert split_launch_options(["--config", "debug"]) == ([], ["--config", "debug"])
    with pytest.raises(ConfigError, match=r"^argument '--nnodes' needs a value: write --nnodes"):
        split_launch_options(["--nnodes", "--training.steps", "3"])
    assert [exit_status(code) for code in (0, 2, -9)] == [0, 2, 137]


def test_torchrun_options_under_torchrun_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    status, _, err = as_train_py(["--nproc-per-node", "2", *tiny_args(tmp_path)], capsys)
    assert status == 2
    assert err.splitlines() == [
        "plugtrain: error: --nproc-per-node starts a job's processes, but torchrun already "
        "started this one as one of them: drop the torchrun options, or run plugtrain train "
        "without torchrun"
    ]


def test_missing_data_file_is_one_line(tmp_path, capsys):
    args = [*tiny_args(tmp_path), "--data.train_path", str(tmp_path / "nope.jsonl")]
    status, _, err = as_train_py(args, capsys)
    assert status == 2, err
    (line,) = err.strip().splitlines()
    assert "nope.jsonl" in line and "data.train_path" in line


def test_a_validation_file_smaller_than_one_batch_stops_before_step_1(tmp_path, capsys):
    # 3 samples of seq_len 32, fewer than one batch of 4: found at start-up, not at step 50.
    text = json.loads(VALIDATION.read_text().splitlines()[0])["text"][:200]
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": text}) + "\n")
    args = ["--validation.interval", "50", "--data.validation_path", str(small)]
    status, _, err = as_train_py([*tiny_args(tmp_path / "run", steps=60), *args], capsys)
    assert status == 2, err
    assert err.strip().splitlines() == [
        f"plugtrain: error: data.validation_path '{small}' has 3 samples of seq_len=32, fewer "
        "than one validation batch of training.batch_size=4: lower training.batch_size or "
        "training.seq_len, or use a larger validation file"
    ]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_training_file_too_small_names_itself(tmp_path, capsys):
    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "Exeunt."}\n')
    argv = [*tiny_args(tmp_path / "run"), "--data.train_path", str(small)]
    assert run_cli(lambda: Trainer(*configure(argv))) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"plugtrain: error: data.train_path '{small}' has 4 tokens, fewer")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_missing_tokenizer_suggests_the_shipped_one_which_any_folder_finds(
    tmp_path, capsys, monkeypatch
):
    args = [*tiny_args(tmp_path), "--model.tokenizer_path", "nope.json"]
    monkeypatch.chdir(tmp_path)  # the repository is not under tmp_path
    status, _, err = as_train_py(args, capsys)
    assert status == 2, err
    (line,) = err.strip().splitlines()
    assert line.endswith(
        "tokenizer file 'nope.json' not found: set model.tokenizer_path to a tokenizer.json "
        "(e.g. sample:tokenizer.json)"
    )
    assert sample.resolve("sample:tokenizer.json").is_file()


def test_help_lists_every_section_and_field(capsys):
    plugins = {
        "grad_clip": GradClipConfig,
        "grad_scaler": GradScalerConfig,
        "hook_recorder": HookRecorderConfig,
    }
    status, out, err = as_train_py(["--plugins.enabled", ",".join(plugins), "--help"], capsys)
    assert status == 0, err
    sections = {
        f.name: f.default_factory
        for f in dataclasses.fields(JobConfig)
        if f.name != "plugin_sections"
    }
    assert len(sections) == 11
    help_lines = out.splitlines()
    for section, cls in {**sections, **plugins}.items():
        assert f"[{section}]" in help_lines, section
        for field in dataclasses.fields(cls):
            documented = [
                line for line in help_lines if line.startswith(f"  --{section}.{field.name} (")
            ]
            assert len(documented) == 1, f"{section}.{field.name}"


def test_help_names_every_installed_plugin_that_is_not_enabled(capsys):
    status, out, err = as_train_py(["--plugins.enabled", "grad_clip", "--help"], capsys)
    assert status == 0, err
    others = ", ".join(sorted(set(installed_plugins()) - {"grad_clip"}))
    assert f"Installed plugins that are not enabled: {others}." in " ".join(out.split())
    assert "[grad_clip]" in out.splitlines()
