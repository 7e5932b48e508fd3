"""Weights out of a CUDA run: ``plugtrain export-hf`` and ``plugtrain generate --device cuda``.

A tiny run trained on CUDA is checkpointed; its export loads in transformers on the same device
with the logits of plugtrain's model, and generation on CUDA writes what it writes on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from plugtrain.cli import main
from plugtrain.commands.generate import load
from plugtrain.testing import tiny_run

PROMPT = "ROMEO:"


@pytest.fixture(scope="module")
def run(tmp_path_factory, device_args) -> Path:
    """A tiny run of 4 steps on the device, checkpointed at its end."""
    folder = tmp_path_factory.mktemp("weights") / "run"
    tiny_run(folder, *device_args, "--checkpoint.enable", "true", "--optimizer.lr", "0.01", steps=4)
    return folder


@pytest.fixture(scope="module")
def exported(run) -> Path:
    """The run's checkpoint as a Hugging Face folder, in float32."""
    out = run.parent / "hf"
    assert main(["export-hf", str(run), "-o", str(out), "--dtype", "float32"]) == 0
    return out


def test_the_export_of_a_cuda_run_gives_plugtrain_logits_in_transformers(run, exported, device):
    transformers = pytest.importorskip("transformers")
    ours, tokenizer = load(run, device)
    tokens = torch.tensor([[tokenizer.bos_id, *tokenizer.encode(PROMPT * 8)]], device=device)
    hf = transformers.LlamaForCausalLM.from_pretrained(exported, dtype=torch.float32)
    hf = hf.to(device).eval()
    with torch.no_grad():
        theirs = hf(tokens).logits
        mine = ours(tokens)
    assert theirs.device.type == mine.device.type == device.type
    assert (theirs - mine).abs().max().item() < 1e-4


def generate_cli(capsys, path: Path, device: str) -> str:
    options = ("--prompt", PROMPT, "--max-new-tokens", "20", "--device", device)
    assert main(["generate", str(path), *options]) == 0
    out, _ = capsys.readouterr()
    return out


def test_generate_on_the_device_writes_what_it_writes_on_the_cpu(run, exported, device, capsys):
    capsys.readouterr()
    on_cpu = generate_cli(capsys, run, "cpu")
    assert len(on_cpu) > 20
    assert generate_cli(capsys, run, device.type) == on_cpu
    assert generate_cli(capsys, exported, device.type) == on_cpu


# Weights in: the import of a Hugging Face folder (``training.initial_load_path``) belongs
# here, as a test that trains on the device from ``exported`` and checks the first step's
# loss against the logits of the exported model (the same module-scoped run and folder).
