"""A LoRA run from a Hugging Face Llama folder, exported and read back by the real clients:
transformers for the merged folder, peft for the adapter folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors import safe_open

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


def test_the_adapter_export_is_a_peft_folder_that_gives_the_merged_logits(run, merged):
    folder = run["root"] / "adapter"
    plugtrain("export-hf", run["run"], "-o", folder, "--adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
        4,
        32,
        str(run["base"]),
    )
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    with safe_open(folder / "adapter_model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    assert len(keys) == 2 * 7 * 2
    base = transformers.LlamaForCausalLM.from_pretrained(run["base"], dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, folder).eval()
    with torch.no_grad():
        logits = adapted(run["tokens"]).logits
    assert (logits - hf_llama_logits(merged, run["tokens"])).abs().max() < 1e-4
    assert (logits - hf_llama_logits(run["base"], run["tokens"])).abs().max() > 1e-2


def test_generate_and_eval_read_a_lora_run_as_its_merged_export(run, merged, tmp_path):
    prompt = ("--prompt", "ROMEO:", "--max-new-tokens", "8")
    assert plugtrain("generate", run["run"], *prompt) == plugtrain("generate", merged, *prompt)
    scores = []
    for path, name in ((run["run"], "run"), (merged, "merged")):
        out = tmp_path / f"{name}.json"
        plugtrain("eval", path, "--tasks", "sample:cloze.jsonl", "--max-items", "8", "-o", out)
        cloze = json.loads(out.read_text())["tasks"]["cloze"]
        scores.append((cloze["items"], cloze["acc"], cloze["acc_norm"]))
    assert scores[0] == scores[1] and scores[0][0] == 8
