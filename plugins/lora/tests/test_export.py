"""A LoRA run from a Hugging Face Llama folder, exported and read back by the real client:
transformers for the merged folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plugtrain.testing import hf_llama_folder, hf_llama_logits, make_trainer

pytestmark = pytest.mark.slow  # a run from a Hugging Face folder, then transformers

LORA = ("--plugins.enabled", "lora", "--lora.rank", "4", "--lora.alpha", "32")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """The base folder, the run's dump folder, tokens, and the trained model's logits."""
    root = tmp_path_factory.mktemp("lora")
    base = hf_llama_folder(root / "base")
    trainer = make_trainer(
        root / "run",
        *LORA,
        *("--model.flavor", "hf", "--checkpoint.initial_load_path", str(base)),
        *("--model.tokenizer_path", "", "--optimizer.lr", "1e-2"),
        *("--checkpoint.enable", "true"),
        steps=4,
    )
    trainer.run()
    tokens = torch.randint(0, trainer.model_args.vocab_size, (2, 24), generator=torch.Generator())
    with torch.no_grad():
        logits = trainer.model.eval()(tokens)
    return {"root": root, "base": base, "run": root / "run", "tokens": tokens, "logits": logits}


def plugtrain(*args: str) -> str:
    """What the ``plugtrain`` command prints, run as a user runs it."""
    command = [sys.executable, "-m", "plugtrain.cli", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def merged(run: dict) -> Path:
    out = run["root"] / "merged"
    plugtrain("export-hf", run["run"], "-o", out)
    return out


def test_the_merged_export_gives_the_adapted_models_logits_in_transformers(run, merged):
    logits = hf_llama_logits(merged, run["tokens"])
    base = hf_llama_logits(run["base"], run["tokens"])
    assert (logits - run["logits"]).abs().max() < 1e-4
    assert (base - run["logits"]).abs().max() > 1e-2
