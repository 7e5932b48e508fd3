"""hf_export: its step-N/hf/ folders against plugtrain export-hf, on 1 and 2 processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from plugtrain_hf_export import HfExport

from plugtrain.plugin import ConfigError
from plugtrain.testing import setup_context, tiny_run

NAME = "hf_export"


def checkpoints(dump_folder: Path) -> list[Path]:
    return sorted((dump_folder / "checkpoints").glob("step-*[0-9]"))


def assert_same_as_the_command(step_folder: Path, tmp_path: Path, *options: str) -> None:
    """``step_folder/hf`` holds the bytes ``plugtrain export-hf step_folder`` writes."""
    out = tmp_path / f"cli-{step_folder.name}"
    command = [sys.executable, "-m", "plugtrain.cli", "export-hf", str(step_folder), "-o", str(out)]
    done = subprocess.run([*command, *options], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    exported = step_folder / "hf"
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(p.name for p in exported.iterdir())
    assert "model.safetensors" in files or "model.safetensors.index.json" in files
    for name in files:
        assert (exported / name).read_bytes() == (out / name).read_bytes(), name


CHECKPOINTED = ("--checkpoint.enable", "true", "--checkpoint.interval", "2")


def test_every_checkpoint_is_exported_as_the_command_exports_it(tmp_path):
    # Async saves: step-2's export runs when training has gone past step 2, and must still hold
    # step 2's weights.
    run = tmp_path / "run"
    async_saves = ("--checkpoint.async_mode", "async")
    tiny_run(run, *CHECKPOINTED, *async_saves, "--plugins.enabled", NAME, steps=4)
    first, last = checkpoints(run)
    assert [first.name, last.name] == ["step-2", "step-4"]
    assert (last / "hf" / "model.safetensors").is_file()
    assert_same_as_the_command(first, tmp_path)


def test_last_only_float32_ema_and_shards(tmp_path):
    run = tmp_path / "run"
    options = {"every": "last", "dtype": "float32", "weights": "ema", "max_shard_size": "100000"}
    args = [x for k, v in options.items() for x in (f"--{NAME}.{k}", v)]
    tiny_run(run, *CHECKPOINTED, "--plugins.enabled", f"ema,{NAME}", *args, steps=4)
    first, last = checkpoints(run)
    assert not (first / "hf").exists()
    assert (last / "hf" / "model.safetensors.index.json").is_file()
    cli = ("--dtype", "float32", "--weights", "ema", "--max-shard-size", "100000")
    assert_same_as_the_command(last, tmp_path, *cli)


def test_ema_weights_need_the_ema_plugin(tmp_path):
    with pytest.raises(ConfigError, match=r"'hf_export.weights' is 'ema', but the ema plugin"):
        tiny_run(tmp_path, "--plugins.enabled", NAME, f"--{NAME}.weights", "ema", steps=1)


def test_a_url_dump_folder_is_refused_in_one_line(tmp_path):
    url, plugin = "s3://bucket/run", HfExport()
    ctx = setup_context(
        {NAME: plugin},
        "--plugins.enabled",
        NAME,
        "--job.dump_folder",
        url,
        "--job.local_folder",
        "x",
    )
    with pytest.raises(ConfigError, match=rf"{NAME}' writes step-<N>/hf/ .* {url} is a URL") as e:
        plugin.setup(ctx)
    assert f"plugtrain export-hf {url} -o FOLDER" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_a_two_process_run_exports_as_the_command_exports_it(tmp_path):
    run = tmp_path / "run"
    tiny_run(run, *CHECKPOINTED, "--plugins.enabled", NAME, steps=2, world_size=2)
    (step,) = checkpoints(run)
    assert len(list(step.glob("*.distcp"))) == 2
    assert_same_as_the_command(step, tmp_path)
