"""README's and the user docs' figures: each one is checked against the code, the config
defaults or a run."""

from __future__ import annotations

import re

import pytest

from plugtrain.config import CheckpointConfig, MetricsConfig, TrainingConfig, ValidationConfig
from plugtrain.model.transformer import FLAVORS
from plugtrain.observability.metrics import format_line
from plugtrain.testing import read_metrics
from plugtrain.training.launch import configure
from plugtrain.training.trainer import Trainer

NUMBER = r"\d[\d.,e+-]*"
"""A number as the console prints it: 8.1219, 1.50e-04, 5,308."""


@pytest.fixture
def readme(repo) -> str:
    return (repo / "README.md").read_text()


@pytest.fixture
def observability(repo) -> str:
    return (repo / "docs" / "observability.md").read_text()


def sample_line(page: str) -> str:
    """The line in the fenced block after docs/observability.md's ``<!-- sample line -->``."""
    found = re.search(r"<!-- sample line -->\n```\n(.+)\n```", page)
    assert found, "docs/observability.md has no '<!-- sample line -->' block"
    return found.group(1)


def fields(line: str) -> dict[str, str]:
    """A console line's values by label, as printed (``{"loss": "8.1219", ...}``)."""
    return dict(re.findall(rf"([a-z/]+) +({NUMBER})", line))


def test_the_run_described_is_the_default_run(repo, readme):
    train, every = TrainingConfig(), "every {} steps"
    assert f"{train.steps} steps of {train.batch_size} x {train.seq_len} tokens" in readme
    assert f"a line {every.format(MetricsConfig().log_freq)}" in readme
    assert f"held-out plays {every.format(ValidationConfig().interval)}" in readme
    checkpoints = (repo / "docs" / "checkpoints.md").read_text()
    assert f"`checkpoint.keep_latest_k` (default {CheckpointConfig().keep_latest_k}," in checkpoints


def test_the_torch_version_is_the_pinned_one(repo, readme):
    (pin,) = re.findall(r"^torch==(\S+)$", (repo / "requirements-dev.txt").read_text(), re.M)
    assert f"installs torch {pin} (pinned" in readme


def test_the_sample_lines_figures_agree_with_each_other(observability):
    """Throughput and TFLOP/s follow from the step time (printed in whole milliseconds)."""
    sample = fields(sample_line(observability))
    train, args = TrainingConfig(), FLAVORS["debug"]
    seconds = float(sample["time"]) / 1000
    tokens_per_sec = train.batch_size * train.seq_len / seconds
    half_ms = 0.5e-3 / seconds  # the relative error of a time rounded to the millisecond
    printed = int(sample["tok/s"].replace(",", ""))
    assert printed == pytest.approx(tokens_per_sec, rel=half_ms)
    flops = args.flops_per_token(train.seq_len) * printed / 1e12
    assert float(sample["tflops"]) == pytest.approx(flops, rel=0.01)


@pytest.mark.slow
def test_the_sample_line_is_the_default_runs_first_step(tmp_path, repo, observability, monkeypatch):
    """Its loss and learning rate are those of ``python train.py``'s first step, and it has
    the fields, in order, that the console prints."""
    monkeypatch.chdir(repo)  # the default config's paths are relative to the repository
    configured = configure(
        ["--job.dump_folder", str(tmp_path), "--training.steps", "1", "--validation.interval", "0"]
    )
    assert configured is not None
    Trainer(*configured).run()
    (record,) = read_metrics(tmp_path)
    sample, printed = sample_line(observability), format_line(record)
    assert re.sub(NUMBER, "N", sample) == re.sub(NUMBER, "N", printed)
    assert {k: fields(sample)[k] for k in ("step", "loss", "lr")} == {
        k: fields(printed)[k] for k in ("step", "loss", "lr")
    }
