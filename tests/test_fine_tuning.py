"""docs/fine-tuning.md's offline chat recipe, run as the docs write it: the debug run, chat
fine-tuning with the shipped ``chat_debug`` config, export-hf and generate, then transformers'
``apply_chat_template`` and ``generate`` on the export.

The judge of the ids is transformers itself: the export's template must render each training
conversation to exactly the ids the run trained on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plugtrain.data import ChatOptions
from plugtrain.data.cache import cache_folder
from plugtrain.data.store import file_sha256
from plugtrain.testing import SAMPLE, stored_documents

transformers = pytest.importorskip("transformers")


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``command`` in ``cwd`` with this python first on the PATH (its ``plugtrain``)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


@pytest.mark.slow  # four processes, two of them training runs
def test_the_offline_chat_recipe_runs_as_written(doc_block, repo, train_py, tmp_path):
    page = repo / "docs" / "fine-tuning.md"
    (tmp_path / "train.py").symlink_to(train_py)
    # The block's commands, each run 2 steps (the command line's step count wins).
    block = doc_block(page, "chat recipe").replace(
        "python train.py", "python train.py --training.steps 2"
    )
    shell = run(["bash", "-e", "-c", block], tmp_path)
    assert shell.returncode == 0, shell.stderr[-3000:]
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
