"""How a run ends early: Ctrl-C (SIGINT) once or twice, and a failure on one rank of several."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from plugtrain.checkpoint.layout import complete_checkpoints
from plugtrain.testing import make_trainer, read_metrics, run_script, tiny_args

CKPT = ("--checkpoint.enable", "true", "--checkpoint.interval", "10000")

PLUGIN = '''
"""A test plugin for train.py subprocesses, driven by environment variables."""
import os
import time

from plugtrain.errors import ConfigError
from plugtrain.plugin import hookimpl


class Raiser:
    def __init__(self):
        self.rank = 0

    @hookimpl
    def setup(self, ctx):
        self.rank = ctx.parallel_dims.rank
        attempts = os.environ.get("RAISER_ATTEMPTS")
        if attempts and ctx.parallel_dims.rank == 1:  # one line per attempt torchrun makes
            with open(attempts, "a") as f:
                f.write(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-") + "\\n")

    @hookimpl
    def post_backward(self, ctx):
        kind, _, where = os.environ.get("RAISER_FAIL", "").partition("@")
        if where == f"{ctx.step}:{self.rank}":
            raise (ConfigError if kind == "user" else RuntimeError)(f"boom at step {ctx.step}")

    @hookimpl
    def post_step(self, ctx):
        seconds, _, first = os.environ.get("RAISER_SLEEP", "0").partition("@")
        if ctx.step >= int(first or 1):
            time.sleep(float(seconds))
'''


@pytest.fixture
def raiser(tmp_path) -> dict[str, str]:
    """The environment that makes the ``raiser`` plugin above loadable by train.py."""
    site = tmp_path / "site"
    (site / "plugtrain_raiser_test-0.0.dist-info").mkdir(parents=True)
    (site / "plugtrain_raiser_test.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "plugtrain_raiser_test-0.0.dist-info"
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: plugtrain-raiser-test\nVersion: 0.0\n"
    )
    (info / "entry_points.txt").write_text(
        "[plugtrain.plugins]\nraiser = plugtrain_raiser_test:Raiser\n"
    )
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}


def start_and_interrupt(
    train_py: Path, args: list[str], env: dict[str, str], gaps: tuple[float, ...]
) -> tuple[int, str]:
    """Start train.py; once it logged step 3, send it SIGINT after each of ``gaps`` seconds;
    return its exit status and stderr."""
    proc = subprocess.Popen(
        [sys.executable, str(train_py), *args],
        stderr=subprocess.PIPE, text=True, cwd=train_py.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env},
    )  # fmt: skip
    assert proc.stderr is not None
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if "step     3 |" in line:
                for gap in gaps:
                    time.sleep(gap)
                    proc.send_signal(signal.SIGINT)
                break
        lines += proc.stderr.readlines()
        return proc.wait(timeout=60), "".join(lines)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpoints", "no-checkpoints"])
def test_ctrl_c_stops_after_the_step_saves_and_exits_zero(tmp_path, raiser, checkpoints, train_py):
    extra = [*CKPT] if checkpoints else []
    # A slow step (0.3 s), so that the signal lands mid-run however busy the machine.
    env = {**raiser, "RAISER_SLEEP": "0.3"}
    args = [*tiny_args(tmp_path, steps=10_000), "--plugins.enabled", "raiser", *extra]
    status, stderr = start_and_interrupt(train_py, args, env, gaps=(0,))
    assert status == 0, stderr
    last = read_metrics(tmp_path)[-1]["step"]  # flushed, up to the step it stopped after
    assert 3 <= last < 10_000
    assert f"stopped after step {last} on SIGINT; " in stderr
    assert "Traceback" not in stderr
    saved = list(complete_checkpoints(tmp_path / "checkpoints"))
    if checkpoints:
        assert saved == [last]
        assert "run the same command to resume" in stderr
    else:
        assert saved == []
        assert "checkpoint.enable is off" in stderr


def test_a_second_ctrl_c_stops_at_once(tmp_path, raiser, train_py):
    env = {**raiser, "RAISER_SLEEP": "2@4"}  # 2 s from step 4 on: both signals land in it
    args = [*tiny_args(tmp_path, steps=10_000), "--plugins.enabled", "raiser", *CKPT]
    # The first Ctrl-C alone would finish step 4 and save after it.
    status, stderr = start_and_interrupt(train_py, args, env, gaps=(0.5, 0.2))
    assert status == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.rstrip().endswith(
        "plugtrain: interrupted (KeyboardInterrupt): stopped at once, without saving"
    )
    assert list(complete_checkpoints(tmp_path / "checkpoints")) == []
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]  # step 4 never ended


def test_a_second_ctrl_c_during_a_save_is_a_keyboard_interrupt(tmp_path, monkeypatch):
    # DCP turns any exception while writing, KeyboardInterrupt too, into a CheckpointException:
    # the second Ctrl-C would end in its traceback, and status 1.
    trainer = make_trainer(tmp_path, *CKPT, steps=8)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trainer.checkpointer.save(1)
    trainer.abort()
    assert list(complete_checkpoints(tmp_path / "checkpoints")) == []


def fail_on_rank_1(
    train_py: Path, tmp_path: Path, raiser: dict[str, str], kind: str, **kw
) -> tuple:
    """train.py on 2 processes, whose rank 1 raises in post_backward of step 5."""
    args = [*tiny_args(tmp_path, steps=10), "--plugins.enabled", "raiser"]
    start = time.monotonic()
    result = run_script(
        train_py,
        args,
        nproc=2,
        timeout=150,
        env={**raiser, "RAISER_FAIL": f"{kind}@5:1", **kw.pop("env", {})},
        **kw,
    )
    return result, time.monotonic() - start


@pytest.mark.slow
def test_a_user_error_on_one_rank_is_reported_and_ends_the_job(tmp_path, raiser, train_py):
    # It used to hang: the failed rank waited in a barrier on its way out, the others in the
    # next step's all-reduce, and neither printed anything. (A bug, a RuntimeError, ends the
    # job too: the torchrun test below.)
    result, seconds = fail_on_rank_1(train_py, tmp_path, raiser, "user")
    assert result.returncode != 0
    assert "[rank 1] plugtrain: error: boom at step 5\n" in result.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    print(f"the job ended {seconds:.1f} s after it started")


@pytest.mark.slow
def test_a_bug_on_one_rank_ends_the_job_and_torchrun_restarts_the_group(tmp_path, raiser, train_py):
    attempts = tmp_path / "attempts"
    result, seconds = fail_on_rank_1(
        train_py,
        tmp_path,
        raiser,
        "bug",
        # See test_checkpoint_distributed.py: restarts need the c10d rendezvous and this.
        env={"RAISER_ATTEMPTS": str(attempts), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        torchrun_args=("--standalone", "--max-restarts=1"),
    )
    assert result.returncode != 0
    assert attempts.read_text().split() == ["0", "1"]
    assert result.stderr.count("RuntimeError: boom at step 5") == 2
    # Each attempt trains from the start and ends at the failure: the metrics are the last's.
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    print(f"the job ended {seconds:.1f} s after it started")
