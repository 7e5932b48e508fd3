"""spike_guard: a spike is skipped as a vetoed step; poisoned data is rewound past."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Collection
from pathlib import Path

import pytest
import torch
from plugtrain_spike_guard import EVENT_LOG

from plugtrain.plugin import SkipRange, StepContext, hookimpl
from plugtrain.testing import (
    PoisonBatches,
    make_trainer,
    parameter_checksums,
    read_metrics,
    run_distributed,
    run_script,
    tiny_run,
)

DETECT = (
    "--plugins.enabled", "spike_guard",
    "--spike_guard.window", "4", "--spike_guard.warmup_steps", "3",
    "--spike_guard.sigma", "6", "--spike_guard.signals", "grad_norm",
)  # fmt: skip


class VetoSteps:
    """Vetoes the chosen steps by hand (a device flag, as spike_guard's)."""

    def __init__(self, steps: Collection[int]) -> None:
        self.steps = set(steps)

    @hookimpl
    def pre_step(self, ctx: StepContext) -> str | None:
        return "by hand" if ctx.step in self.steps else None


class KillOnLoad:
    """kill -9 of its own process the first time plugin states are loaded (a resume or a
    rewind), once per ``marker`` file."""

    def __init__(self, marker: str) -> None:
        self.marker = Path(marker)

    @hookimpl
    def state_dict(self) -> dict:
        return {"unused": 0}

    @hookimpl
    def load_state_dict(self, state_dict: dict) -> None:
        if not self.marker.exists():
            self.marker.write_text("killed")
            os.kill(os.getpid(), signal.SIGKILL)


def events(folder: Path) -> list[dict]:
    path = folder / EVENT_LOG
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_spike_is_skipped_as_a_step_vetoed_by_hand(tmp_path):
    guarded = tiny_run(
        tmp_path / "guarded",
        *DETECT, "--spike_guard.max_consecutive", "0",
        plugins=[("poison", PoisonBatches({6}))],
        steps=7,
    )  # fmt: skip
    by_hand = tiny_run(tmp_path / "by_hand", plugins=[("veto", VetoSteps({6}))], steps=7)
    assert guarded.skipped_steps == [6]
    assert [(e["event"], e["step"], e["cause"]) for e in events(guarded.dump_folder)] == [
        ("skip", 6, "spike")
    ]
    assert guarded.checksums == by_hand.checksums
    last = guarded.metrics[-1]
    assert last["spike_guard/skipped.spike"] == 1
    assert last["skipped_steps.spike_guard"] == 1


# Batches 6-8 are poisoned. Steps 6 and 7 spike; read at step 7 (every step logs), that is
# max_consecutive = 2 skips in a row: rewind to the latest checkpoint at or before step
# 6 - rewind_min_steps = 5, step-4, and skip batches 5 through 7 + skip_margin = 8.
POISONED = {6, 7, 8}
REWIND = (
    *DETECT,
    "--spike_guard.max_consecutive", "2", "--spike_guard.rewind_min_steps", "1",
    "--spike_guard.skip_margin", "1",
    "--checkpoint.enable", "true", "--checkpoint.interval", "2",
    "--checkpoint.async_mode", "disabled",
)  # fmt: skip
STEPS = 8


def rewinding_run(folder: str, marker: str | None = None) -> object:
    """The run over poisoned data, with a kill -9 during its first load if ``marker``."""
    plugins: list = [("poison", PoisonBatches(POISONED))]
    if marker is not None:
        plugins.append(("kill", KillOnLoad(marker)))
    trainer = make_trainer(folder, *REWIND, steps=STEPS, plugins=plugins)
    trainer.run()
    return trainer


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The checksum of the run without poison, given batches 5-8 to skip from the start."""
    folder = tmp_path_factory.mktemp("reference")
    ranges = [{"first": 5, "last": 8, "source": "test", "reason": "given"}]
    (folder / "data_skips.json").write_text(json.dumps({"ranges": ranges, "rewind": None}))
    trainer = make_trainer(folder, *DETECT, "--spike_guard.max_consecutive", "0", steps=STEPS)
    trainer.run()
    return parameter_checksums(trainer.model)


def test_poisoned_batches_are_rewound_past(tmp_path, reference):
    trainer = rewinding_run(str(tmp_path / "run"))
    assert parameter_checksums(trainer.model) == reference
    log = [(e["event"], e["step"]) for e in events(tmp_path / "run")]
    assert log == [("skip", 6), ("skip", 7), ("rewind_requested", 7), ("rewind", 7)]
    assert events(tmp_path / "run")[-1]["loaded_step"] == 4
    assert events(tmp_path / "run")[-1]["batches"] == [5, 8]
    skips = json.loads((tmp_path / "run" / "data_skips.json").read_text())
    assert skips["rewind"] is None
    assert [(r["first"], r["last"], r["source"]) for r in skips["ranges"]] == [
        (5, 8, "spike_guard")
    ]
    assert read_metrics(tmp_path / "run")[-1]["spike_guard/rewinds"] == 1


SCRIPT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("spike_guard_tests", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module.rewinding_run(sys.argv[2], sys.argv[3])
"""


def test_a_kill_during_a_rewind_resumes_into_the_same_run(tmp_path, reference):
    script, folder, marker = tmp_path / "run.py", tmp_path / "run", tmp_path / "killed"
    script.write_text(SCRIPT)
    # With the test process's thread count: the resume, in this process, must add alike.
    threads = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    killed = run_script(script, [__file__, str(folder), str(marker)], env=threads)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    unfinished = json.loads((folder / "data_skips.json").read_text())["rewind"]
    assert (unfinished["step"], unfinished["to_step"]) == (7, 5)
    assert (folder / "checkpoints" / "step-6").is_dir()  # the rewind had not deleted it yet
    resumed = rewinding_run(str(folder), str(marker))
    assert resumed.step == STEPS
    assert parameter_checksums(resumed.model) == reference


def rewind_on_one_rank(folder: str) -> dict:
    trainer = rewinding_run(folder)
    rewinds = [(r.step, r.loaded_step, r.skipped) for r in trainer.control.rewinds]
    return {"step": trainer.step, "rewinds": rewinds}


@pytest.mark.slow
def test_two_processes_rewind_alike(tmp_path):
    ranks = run_distributed(rewind_on_one_rank, 2, str(tmp_path))
    rewind = (7, 4, SkipRange(5, 8, "spike_guard", ranks[0]["rewinds"][0][2].reason))
    assert ranks == [{"step": STEPS, "rewinds": [rewind]}] * 2
    assert [(e["event"], e["step"]) for e in events(tmp_path)] == [
        ("skip", 6), ("skip", 7), ("rewind_requested", 7), ("rewind", 7)
    ]  # fmt: skip
