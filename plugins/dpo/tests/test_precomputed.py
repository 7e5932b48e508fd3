"""dpo's ``reference = "precomputed"``: the copy's losses and metrics from log-probs computed
once before step 1, stored beside the prepared data, read again by a rerun and a resume,
never from another start, and under FSDP2 (trl #6470) and tensor parallelism.

These tests import only the plugin API and the test kit (``plugtrain.testing``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from plugtrain_dpo import Dpo
from plugtrain_dpo.precomputed import FOLDER
from torch.distributed.tensor import DTensor

from plugtrain.plugin import PluginError, SetupContext
from plugtrain.testing import (
    SAMPLE,
    interrupted_and_resumed,
    make_trainer,
    read_metrics,
    run_distributed,
)

NAME = "dpo"
PRECOMPUTED = ("--dpo.reference", "precomputed")


def pairs(folder: Path) -> tuple[str, ...]:
    """A run on the first pairs of the sample's (the pre-pass reads every pair: a few keep it
    short), validating on the first of its validation pairs, in files of the test's own: the
    session's data cache holds no log-probs of them from another test."""
    folder.mkdir(parents=True, exist_ok=True)
    subsets = {}
    for name, lines in (("preference_train", 60), ("preference_validation", 24)):
        subsets[name] = folder / f"{name}.jsonl"
        head = (SAMPLE / f"{name}.jsonl").read_text().splitlines(keepends=True)[:lines]
        subsets[name].write_text("".join(head))
    return (
        *("--plugins.enabled", NAME, "--training.seq_len", "256", "--training.batch_size", "4"),
        *("--data.train_path", str(subsets["preference_train"])),
        *("--validation.interval", "2", "--validation.steps", "2"),
        *("--data.validation_path", str(subsets["preference_validation"])),
    )


def stored(plugin: Dpo) -> list[Path]:
    """The files of ``plugin``'s reference log-probs, one beside each prepared folder."""
    logps = plugin.precomputed
    return sorted({logps.path(i) for i in range(len(logps.datasets))})


def records(folder: Path) -> list[dict]:
    """Each logged record's loss (or validation loss) and dpo metrics."""
    keep = ("loss", "validation_loss")
    return [
        {k: v for k, v in r.items() if k in keep or k.startswith("dpo/")}
        for r in read_metrics(folder)
        if any(k in r for k in keep)
    ]


def assert_close(mine: list[dict], theirs: list[dict], tol: float) -> None:
    assert len(mine) == len(theirs)
    for m, t in zip(mine, theirs, strict=True):
        assert m.keys() == t.keys() and all(abs(m[k] - t[k]) < tol for k in m), (mine, theirs)


def _no_frozen_copy(self: SetupContext) -> None:
    raise AssertionError("precomputed built a frozen copy")


def test_precomputed_gives_the_copys_losses_and_metrics_and_is_read_again(tmp_path, monkeypatch):
    """2 fp32 steps of 2 microbatches and a validation: the copy's losses and dpo metrics,
    training and validation, within 1e-6, with no second model; each pair's log-probs are
    computed once, and stored beside each prepared folder."""
    args = (*pairs(tmp_path / "data"), "--training.grad_accum_steps", "2")
    copy = make_trainer(tmp_path / "copy", *args, steps=2)
    copy.run()
    copy.close()
    monkeypatch.setattr(SetupContext, "frozen_copy", _no_frozen_copy)
    plugin = Dpo()
    run = make_trainer(tmp_path / "pre", *args, *PRECOMPUTED, steps=2, plugins=[(NAME, plugin)])
    run.run()
    run.close()
    assert plugin.reference is None and set(plugin.state_dict()) == {"precomputed"}
    theirs = records(tmp_path / "copy")
    assert len(theirs) == 3 and abs(theirs[0]["loss"] - math.log(2)) < 1e-6
    assert_close(records(tmp_path / "pre"), theirs, 1e-6)
    samples = sum(len(d) for d in plugin.precomputed.datasets)
    files = stored(plugin)
    assert plugin.precomputed.computed == samples and len(files) == 2
    assert all(f.parent.name == FOLDER and f.parent.parent.is_dir() for f in files)


def _fresh(made: list[Dpo]):
    def plugins() -> list[tuple[str, Dpo]]:
        made.append(Dpo())
        return [(NAME, made[-1])]

    return plugins


@pytest.mark.slow  # five runs: seconds
def test_precomputed_is_computed_once_across_a_resume_and_never_from_another_start(tmp_path):
    """From an initial load (which a resume skips): the straight run computes each pair's
    log-probs, the checkpointed run and its resume read them (none computed) and continue
    bitwise; a run from another start (the seeded init) computes its own, step 1 ln 2; a
    resume whose file is damaged or gone stops in one line."""
    base = make_trainer(tmp_path / "base", "--checkpoint.save_final", "true")
    base.run()
    start = ("--checkpoint.initial_load_path", str(tmp_path / "base"))
    run = pairs(tmp_path / "data")
    args = (*run, *PRECOMPUTED, *start)
    made: list[Dpo] = []
    result = interrupted_and_resumed(
        tmp_path / "dpo", *args, steps=4, stop_after=2, plugins=_fresh(made)
    )
    assert result["step_at_resume"] == 2 and result["resumed"] == result["straight"]
    straight = [r["loss"] for r in result["straight_metrics"] if "loss" in r]
    resumed = [r["loss"] for r in result["resumed_metrics"] if "loss" in r]
    assert resumed == straight and abs(straight[0] - math.log(2)) < 1e-6
    samples = sum(len(d) for d in made[0].precomputed.datasets)
    assert [p.precomputed.computed for p in made] == [samples, 0, 0]
    files = stored(made[0])
    assert all(stored(p) == files for p in made)

    other = Dpo()  # the seeded init, on the same data: another start, another key
    trainer = make_trainer(tmp_path / "other", *run, *PRECOMPUTED, steps=1,
                           plugins=[(NAME, other)])  # fmt: skip
    trainer.run()
    trainer.close()
    assert other.precomputed.computed == samples and not set(stored(other)) & set(files)
    assert abs(read_metrics(tmp_path / "other")[0]["loss"] - math.log(2)) < 1e-6

    resume = (tmp_path / "dpo" / "resumed", "--checkpoint.enable", "true", *args)
    np.save(files[0], np.zeros(3, dtype=np.float32))
    with pytest.raises(PluginError, match=r"holds \(3,\) float32 values, not one float32 ") as e:
        make_trainer(*resume, steps=6)
    assert "\n" not in str(e.value) and str(files[0]) in str(e.value)
    files[0].unlink()
    with pytest.raises(PluginError, match=r"that this run trained with .* are gone, and a ") as e:
        make_trainer(*resume, steps=6)
    assert "\n" not in str(e.value)


LAYOUTS = {"fsdp": (), "tp": ("--parallelism.tp", "2")}
"""2 processes: FSDP2 over both (each computes half the samples), or tensor parallelism over
both (the logits split over the vocabulary: both compute every sample)."""


def _layouts(folder: str) -> dict:
    """4 fp32 steps of 2 microbatches on this rank in each of ``LAYOUTS``, precomputed then
    copy: the losses, the samples this rank computed and whether every parameter was a
    sharded DTensor after the pre-pass (FSDP2 resharded it)."""
    got: dict = {}
    for name, layout in LAYOUTS.items():
        for reference in ("precomputed", "copy"):
            plugin, where = Dpo(), Path(folder) / name / reference
            args = (*pairs(Path(folder) / "data"), "--training.grad_accum_steps", "2", *layout)
            args = (*args, "--dpo.reference", reference)
            trainer = make_trainer(where, *args, steps=4, plugins=[(NAME, plugin)])
            if reference == "precomputed":
                got[name, "computed"] = plugin.precomputed.computed
                got["samples"] = sum(len(d) for d in plugin.precomputed.datasets)
                got[name, "sharded"] = all(
                    isinstance(p, DTensor) and all(pl.is_shard() for pl in p.placements)
                    for p in trainer.model.parameters()
                )
            trainer.run()
            trainer.close()
            got[name, reference] = [r["loss"] for r in read_metrics(where) if "loss" in r]
    return got


@pytest.mark.slow  # two spawned processes
def test_precomputed_under_fsdp2_and_tp_gives_the_copys_losses(tmp_path):
    """trl #6470 crashed under FSDP2: 2 ranks share the pre-pass (each computes half the
    samples, the policy resharded after it), or under tensor parallelism both compute every
    sample, and either gives the sharded copy's losses within 1e-6."""
    ranks = run_distributed(_layouts, 2, str(tmp_path))
    samples = ranks[0]["samples"]
    assert sum(r["fsdp", "computed"] for r in ranks) == samples
    assert all(r["tp", "computed"] == samples for r in ranks)
    for rank in ranks:
        assert rank["fsdp", "sharded"]
        for name in LAYOUTS:
            mine, theirs = rank[name, "precomputed"], rank[name, "copy"]
            assert len(mine) == 4 and abs(mine[0] - math.log(2)) < 1e-6
            assert all(abs(a - b) < 1e-6 for a, b in zip(mine, theirs, strict=True)), rank
