"""dpo on resume: the objective and the kind of reference are the run's, kept on resume.

A ``copy`` reference saves its weights with each checkpoint and ``adapters_off`` saves none:
a resume that switched to ``copy`` would copy the seeded init (a resume skips the initial
load), one that switched to ``adapters_off`` would find state it has no use for. So each of
``[dpo]``'s settings is refused in one line when a resume changes it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plugtrain.testing import SAMPLE, make_trainer

PAIRS = ("--data.train_path", str(SAMPLE / "preference_train.jsonl"), "--training.seq_len", "256")
LORA = ("--plugins.enabled", "lora,dpo", "--lora.rank", "4", "--checkpoint.enable", "true")
RUN = (*PAIRS, *LORA, "--dpo.reference", "adapters_off")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 1-step lora + dpo run's dump folder (the adapters_off reference: nothing saved for
    it), with its checkpoint."""
    folder = tmp_path_factory.mktemp("dpo")
    make_trainer(folder, *RUN, steps=1).run()
    return folder


@pytest.mark.parametrize(
    ("key", "value", "ours", "theirs"),
    [
        ("reference", "copy", "'copy'", "'adapters_off'"),  # else: a copy of the seeded init
        ("beta", "0.5", "0.5", "0.1"),
        ("loss_type", "ipo", "'ipo'", "'sigmoid'"),
    ],
)
def test_a_resume_that_changes_the_objective_or_the_reference_is_refused(
    saved, key, value, ours, theirs
):
    records = sorted(p.name for p in saved.iterdir())
    with pytest.raises(Exception) as e:
        make_trainer(saved, *RUN, f"--dpo.{key}", value, steps=2)
    step1 = saved / "checkpoints" / "step-1"
    assert type(e.value).__name__ == "CheckpointError" and str(e.value) == (
        f"dpo.{key} is {ours} in this run but {theirs} in checkpoint {step1}, and a resumed "
        f"run keeps the settings it started with: drop --dpo.{key} (or set it back), or "
        "start a new run in another job.dump_folder"
    )
    assert sorted(p.name for p in saved.iterdir()) == records
