"""How a run ends early: a failure on one rank of several."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest
from conftest import read_metrics
from runs import run_train_py, tiny_args

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
        self.rank = ctx.rank
        attempts = os.environ.get("RAISER_ATTEMPTS")
        if attempts and ctx.rank == 1:  # one line per attempt torchrun makes
            with open(attempts, "a") as f:
                f.write(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-") + "\\n")

    @hookimpl
    def post_backward(self, ctx):
        kind, _, where = os.environ.get("RAISER_FAIL", "").partition("@")
        if where == f"{ctx.step}:{self.rank}":
            raise (ConfigError if kind == "user" else RuntimeError)(f"boom at step {ctx.step}")

    @hookimpl
    def post_step(self, ctx):
        time.sleep(float(os.environ.get("RAISER_SLEEP", "0")))
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


def fail_on_rank_1(tmp_path: Path, raiser: dict[str, str], kind: str, **kw) -> tuple:
    """train.py on 2 processes, whose rank 1 raises in post_backward of step 5."""
    args = [*tiny_args(tmp_path, steps=10), "--plugins.enabled", "raiser"]
    start = time.monotonic()
    result = run_train_py(
        args,
        nproc=2,
        timeout=150,
        env={**raiser, "RAISER_FAIL": f"{kind}@5:1", **kw.pop("env", {})},
        **kw,
    )
    return result, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bug", "user"])
def test_a_failure_on_one_rank_is_reported_and_ends_the_job(tmp_path, raiser, kind):
    # It used to hang: the failed rank waited in a barrier on its way out, the others in the
    # next step's all-reduce, and neither printed anything.
    result, seconds = fail_on_rank_1(tmp_path, raiser, kind)
    assert result.returncode != 0
    if kind == "bug":
        assert "RuntimeError: boom at step 5" in result.stderr
    else:
        assert "[rank 1] plugtrain: error: boom at step 5\n" in result.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    print(f"the job ended {seconds:.1f} s after it started")


@pytest.mark.slow
def test_torchrun_restarts_the_group_after_a_failure_on_one_rank(tmp_path, raiser):
    attempts = tmp_path / "attempts"
    result, _ = fail_on_rank_1(
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
