"""A disk that fills up during a run: one line naming the folder, no checkpoint lost, and the same
command resumes once space is freed (on a small tmpfs, where this machine lets a test mount one)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from plugtrain.plugin import StepContext, hookimpl
from plugtrain.testing import make_trainer, parameter_checksums, read_metrics
from plugtrain.training.launch import run_cli

CKPT = ("--checkpoint.enable", "true", "--checkpoint.interval", "2")
STEPS = 6


class FillDisk:
    """Another program fills the disk during ``step``: a ballast file grows until writes fail."""

    def __init__(self, ballast: Path, step: int) -> None:
        self.ballast, self.step = ballast, step

    @hookimpl
    def step_metrics(self, ctx: StepContext) -> None:
        if ctx.step == self.step:
            with self.ballast.open("wb", buffering=0) as f:
                for size in (2**16, 1):  # to the last byte
                    try:
                        while f.write(b"\0" * size):
                            pass
                    except OSError:
                        pass


@pytest.fixture
def small_disk(tmp_path):
    folder = tmp_path / "disk"
    folder.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder)],
                           capture_output=True)  # fmt: skip
    if mount.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def stopped_by_a_full_disk(run, steps: int, fill_at: int, *args: str, capsys) -> str:
    """Train in ``run`` until the disk fills during step ``fill_at``; the one error line."""
    fill = FillDisk(run.parent / "ballast", fill_at)
    trainer = make_trainer(run, *args, steps=steps, plugins=[("fill", fill)])
    capsys.readouterr()
    assert run_cli(trainer.run) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("plugtrain: error:")]
    return line


@pytest.mark.slow
def test_a_full_disk_while_saving_keeps_the_checkpoints_and_the_same_command_resumes(
    tmp_path, small_disk, capsys
):
    straight = make_trainer(tmp_path / "straight", *CKPT, steps=STEPS)
    straight.run()
    run = small_disk / "run"
    line = stopped_by_a_full_disk(run, STEPS, 5, *CKPT, capsys=capsys)
    checkpoints = run / "checkpoints"
    assert line.startswith(f"plugtrain: error: cannot save checkpoint {checkpoints / 'step-6'}: ")
    assert f"MiB free in {checkpoints}); the previous checkpoints are intact" in line
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-4"]
    (small_disk / "ballast").unlink()
    resumed = make_trainer(run, *CKPT, steps=STEPS)
    assert resumed.step == 4
    resumed.run()
    assert parameter_checksums(resumed.model) == parameter_checksums(straight.model)
    records = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == [r["loss"] for r in read_metrics(tmp_path / "straight")]


@pytest.mark.slow
def test_a_full_disk_while_logging_is_one_line_naming_the_file(tmp_path, small_disk, capsys):
    # tmpfs gives space by pages: the metrics file fails once it needs a new one (~7 records),
    # before the first checkpoint is due.
    run = small_disk / "run"
    line = stopped_by_a_full_disk(run, 12, 1, "--checkpoint.enable", "true", capsys=capsys)
    assert re.fullmatch(
        rf"plugtrain: error: cannot write {re.escape(str(run / 'metrics.jsonl'))}: No space left "
        rf"on device \([\d.]+ MiB free in {re.escape(str(run))}\); free space or set "
        r"job\.dump_folder elsewhere, then run the same command: it resumes from the latest "
        r"complete checkpoint",
        line,
    ), line
