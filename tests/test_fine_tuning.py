"""docs/fine-tuning.md's recipes, run as the docs write them.

The offline chat recipe: the debug run, chat fine-tuning with the shipped ``chat_debug``
config, export-hf and generate, then transformers' ``apply_chat_template`` and ``generate`` on
the export. The judge of the ids is transformers itself: the export's template must render
each training conversation to exactly the ids the run trained on.

The Hugging Face recipe: a Llama folder, SFT, its export, DPO from it, the DPO export, then
transformers chats with it (the template carried through both runs)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from plugtrain.cli import main
from plugtrain.data import ChatOptions
from plugtrain.data.cache import cache_folder
from plugtrain.data.store import file_sha256
from plugtrain.testing import SAMPLE, hf_llama_folder, read_metrics, stored_documents
from plugtrain.testing.hf import hf_chat_tokenizer

transformers = pytest.importorskip("transformers")


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``command`` in ``cwd`` with this python first on the PATH (its ``plugtrain``)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def run_block(doc_block, page: Path, label: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the bash block ``label`` of ``page`` in ``cwd``, each training run 2 steps (the
    command line's step count wins)."""
    block = doc_block(page, label).replace("python train.py", "python train.py --training.steps 2")
    shell = run(["bash", "-e", "-c", block], cwd)
    assert shell.returncode == 0, shell.stderr[-3000:]
    return shell


@pytest.mark.slow  # four processes, two of them training runs
def test_the_offline_chat_recipe_runs_as_written(doc_block, repo, train_py, tmp_path):
    page = repo / "docs" / "fine-tuning.md"
    (tmp_path / "train.py").symlink_to(train_py)
    shell = run_block(doc_block, page, "chat recipe", tmp_path)
    # The fine-tuning started from the debug run, cut no conversation, validated on chat.
    assert "initial load from outputs/run/checkpoints/step-2 (" in shell.stderr
    for key, name, count in (("train", "chat_train", 600), ("validation", "chat_validation", 60)):
        said = f"data.{key}_path 'sample:{name}.jsonl': {count} conversations; 0 longer than 192"
        assert said in shell.stderr
    python = run([sys.executable, "-c", doc_block(page, "chat recipe in transformers")], tmp_path)
    assert python.returncode == 0, python.stderr[-3000:]
    # transformers' greedy answer is plugtrain generate's, on the same export.
    assert shell.stdout.endswith(python.stdout)
    # The ids: the export's template in transformers, against the run's prepared data.
    config = json.loads((tmp_path / "outputs" / "chat" / "config.json").read_text())
    data, seq_len = config["data"], config["training"]["seq_len"]
    options = ChatOptions(data["format"], data["chat_template"], seq_len, data["chat_overlong"])
    train = SAMPLE / "chat_train.jsonl"
    trained = stored_documents(cache_folder(train, file_sha256(SAMPLE / "tokenizer.json"),
                                            data["text_field"], options))  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "outputs" / "chat-hf")
    conversations = [json.loads(line)["messages"] for line in train.read_text().splitlines()]
    theirs = [
        tokenizer.apply_chat_template(m, tokenize=True, return_dict=False) for m in conversations
    ]
    assert len(trained) == 600 and theirs == trained


@pytest.mark.slow  # four processes, two of them training runs
def test_the_hugging_face_sft_then_dpo_recipe_runs_as_written(
    doc_block, repo, train_py, tmp_path, monkeypatch, capsys
):
    page = repo / "docs" / "fine-tuning.md"
    (tmp_path / "train.py").symlink_to(train_py)
    folder = tmp_path / "path" / "to" / "Llama-3.2-1B-Instruct"  # the recipe's MODEL
    hf_llama_folder(folder, tokenizer=False, vocab_size=2053, max_position_embeddings=512)
    hf_chat_tokenizer(folder, "llama3")
    stderr = run_block(doc_block, page, "dpo recipe", tmp_path).stderr
    monkeypatch.chdir(tmp_path)
    # DPO started from the SFT export, its policy the reference: step 1 is ln 2.
    assert "initial load from runs/sft-hf (" in stderr
    losses = [r["loss"] for r in read_metrics(tmp_path / "runs" / "dpo") if "loss" in r]
    assert len(losses) == 2 and abs(losses[0] - math.log(2)) < 1e-6, losses
    norms = []
    for export in ("sft-hf", "dpo-hf"):
        with safe_open(tmp_path / "runs" / export / "model.safetensors", framework="pt") as f:
            norms.append(f.get_tensor("model.norm.weight"))
    assert not norms[0].equal(norms[1])  # DPO trained the SFT model
    # The original folder's template, carried through both runs, renders the same ids.
    messages = [{"role": "user", "content": "What is 12 plus 30?"}]
    tokenizers = [transformers.AutoTokenizer.from_pretrained(f) for f in (folder, "runs/dpo-hf")]
    ids = [t.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
           for t in tokenizers]  # fmt: skip
    assert ids[0] == ids[1] and "<|start_header_id|>user" in tokenizers[0].decode(ids[0])
    # transformers chats with the export, greedily as plugtrain generate does.
    prompt = ("--prompt", messages[0]["content"], "--max-new-tokens", "24", "--device", "cpu")
    assert main(["generate", "runs/dpo-hf", "--chat", *prompt]) == 0
    ours = capsys.readouterr().out
    exec(doc_block(page, "dpo recipe in transformers"), {})
    theirs = capsys.readouterr().out
    assert theirs.strip() and ours.endswith(theirs), (ours, theirs)
