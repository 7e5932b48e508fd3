"""``sample:NAME`` names the shipped sample's file wherever a tokenizer or data path is read."""

from __future__ import annotations

import pytest

from plugtrain.cli import main
from plugtrain.data.sources import expand_inputs
from plugtrain.data.tokenizer import Tokenizer
from plugtrain.testing import SAMPLE

VOCAB = Tokenizer.from_file(SAMPLE / "tokenizer.json").vocab_size


def test_estimate_reads_the_flavors_sample_tokenizer(capsys):
    # The debug flavor's config names sample:tokenizer.json: its vocabulary sizes the estimate.
    assert main(["estimate", "debug", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert f"debug model, vocab {VOCAB}, 2 process(es)" in out
    assert "not found" not in out


def test_estimate_says_when_the_tokenizer_is_missing(capsys):
    # The negative control: a tokenizer that is not there falls back to the flavor's vocabulary.
    args = ["estimate", "debug", "--model.tokenizer_path", "sample:gone.json"]
    assert main(args) == 0
    assert "(the flavor's: sample:gone.json not found)" in capsys.readouterr().out


def test_a_tokenizer_and_data_inputs_by_sample_name():
    assert Tokenizer.from_file("sample:tokenizer.json").vocab_size == VOCAB
    assert expand_inputs(["sample:train.jsonl", "sample:valid*.jsonl"]) == [
        SAMPLE / "train.jsonl",
        SAMPLE / "validation.jsonl",
    ]


def test_generate_takes_a_sample_tokenizer_for_a_folder_without_one(tmp_path):
    pytest.importorskip("transformers")
    from plugtrain.commands.generate import from_hf_folder
    from plugtrain.testing import hf_llama_folder

    folder = hf_llama_folder(tmp_path / "hf", tokenizer=False)
    *_, tokenizer = from_hf_folder(folder, "sample:tokenizer.json")
    assert tokenizer.vocab_size == VOCAB
