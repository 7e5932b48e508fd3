"""A LoRA run's checkpoints: the adapters, the optimizer and the run's state, not the base,
which is re-read from the initial load, checked by hash; a resume continues bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from plugtrain.testing import (
    hf_llama_folder,
    interrupted_and_resumed,
    make_trainer,
    run_distributed,
)

LORA = ("--plugins.enabled", "lora", "--lora.rank", "4", "--lora.alpha", "8")


def initial(folder: Path) -> tuple[str, ...]:
    return (
        *("--model.flavor", "hf", "--checkpoint.initial_load_path", str(folder)),
        *("--model.tokenizer_path", ""),
    )


def checkpoint_keys(folder: Path) -> set[str]:
    return set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@pytest.mark.slow
def test_a_checkpoint_leaves_the_base_out_and_a_resume_is_bitwise(tmp_path):
    base = hf_llama_folder(tmp_path / "base")
    result = interrupted_and_resumed(tmp_path, *LORA, *initial(base), steps=4, stop_after=2)
    assert result["stopped_at"] == result["step_at_resume"] == 2
    assert result["resumed"] == result["straight"]

    def losses(records):
        return [(r["step"], r["loss"]) for r in records if "loss" in r]

    assert losses(result["resumed_metrics"]) == losses(result["straight_metrics"])
    checkpoint = tmp_path / "resumed" / "checkpoints" / "step-4"
    keys = checkpoint_keys(checkpoint)
    model = {k for k in keys if k.startswith("model.")}
    assert model and all(".lora_" in k for k in model)
    assert "base.sha256" in keys
    # Smaller than the base by at least the base's size: it holds none of it.
    weights = base / "model.safetensors"
    assert folder_bytes(checkpoint) < weights.stat().st_size
    # A resume without the initial load has nowhere to re-read the base from: one line.
    no_initial = (
        *("--model.flavor", "hf", "--model.hf_config", str(base)),
        *("--model.tokenizer_path", str(base / "tokenizer.json")),
    )
    with pytest.raises(Exception, match="which this run does not set: set it to") as e:
        make_trainer(tmp_path / "resumed", *LORA, *no_initial, "--checkpoint.enable", "true")
    assert type(e.value).__name__ == "CheckpointError" and "\n" not in str(e.value)
    # One that turns save_base on re-reads the base its checkpoint left out, then saves it
    # too, under the base's own keys.
    saving = ("--lora.save_base", "true", "--checkpoint.enable", "true")
    full = make_trainer(tmp_path / "resumed", *LORA, *initial(base), *saving, steps=5)
    assert full.checkpointer.resumed_from["step"] == 4
    full.run()
    full_keys = checkpoint_keys(tmp_path / "resumed" / "checkpoints" / "step-5")
    assert "model.layers.0.attention.wq.weight" in full_keys and "base.sha256" not in full_keys


def resumed_on_ranks(root: str, folder: str) -> dict:
    """On each rank: the run stopped at step 2 and resumed, against the straight one."""
    result = interrupted_and_resumed(root, *LORA, *initial(Path(folder)), steps=4, stop_after=2)
    return {k: result[k] for k in ("stopped_at", "step_at_resume", "straight", "resumed")}


@pytest.mark.slow
def test_two_processes_resume_bitwise_with_the_base_reread_by_each_rank(tmp_path):
    base = hf_llama_folder(tmp_path / "base")
    ranks = run_distributed(resumed_on_ranks, 2, str(tmp_path / "run"), str(base))
    for rank in ranks:
        assert rank["stopped_at"] == rank["step_at_resume"] == 2
        assert rank["resumed"] == rank["straight"]
    keys = checkpoint_keys(tmp_path / "run" / "resumed" / "checkpoints" / "step-4")
    assert all(".lora_" in k for k in keys if k.startswith("model.")) and "base.sha256" in keys


@pytest.mark.slow
def test_a_resume_from_a_changed_base_is_refused_in_one_line(tmp_path):
    base = hf_llama_folder(tmp_path / "base")
    args = (*LORA, *initial(base), "--checkpoint.enable", "true")
    make_trainer(tmp_path / "run", *args, steps=2).run()
    records = sorted(p.name for p in (tmp_path / "run").iterdir())
    shutil.rmtree(base)
    hf_llama_folder(base, seed=1)  # the same shapes, other weights
    with pytest.raises(Exception, match="is not the base checkpoint") as e:
        make_trainer(tmp_path / "run", *args, steps=4)
    assert type(e.value).__name__ == "CheckpointError" and "\n" not in str(e.value)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == records
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in metrics if "loss" in line] == [1, 2]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 2-step LoRA run's dump folder, with its checkpoint of step 2."""
    folder = tmp_path_factory.mktemp("saved")
    make_trainer(folder, *LORA, "--checkpoint.enable", "true", steps=2).run()
    return folder


ALL = ["wq", "wk", "wv", "wo", "w1", "w2", "w3"]


@pytest.mark.parametrize(
    ("key", "value", "ours", "theirs"),
    [
        ("rank", "8", "8", "4"),  # other adapter shapes: not taken for another model
        ("alpha", "16", "16.0", "8.0"),  # the same shapes: it would load and scale them else
        ("targets", "wq,wv", str(["wq", "wv"]), str(ALL)),
    ],
)
def test_a_resume_that_changes_an_adapter_setting_is_refused_in_one_line(
    saved, key, value, ours, theirs
):
    records = sorted(p.name for p in saved.iterdir())
    with pytest.raises(Exception) as e:
        make_trainer(saved, *LORA, f"--lora.{key}", value, "--checkpoint.enable", "true")
    step2 = saved / "checkpoints" / "step-2"
    assert type(e.value).__name__ == "CheckpointError" and str(e.value) == (
        f"lora.{key} is {ours} in this run but {theirs} in checkpoint {step2}, and a resumed "
        f"run keeps the settings it started with: drop --lora.{key} (or set it back), or "
        "start a new run in another job.dump_folder"
    )
    assert sorted(p.name for p in saved.iterdir()) == records
