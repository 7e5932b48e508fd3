"""Real Hugging Face Llama folders (plain, tied, RoPE-scaled) into plugtrain's model and back.

Each folder is saved by transformers itself (``plugtrain.testing.hf_llama_folder``); the import
reads it with ``model_args_from_hf`` and ``from_hf`` and must give transformers' fp32 logits
on the sample's tokens, and the export must give back its tensors bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from plugtrain import sample
from plugtrain.checkpoint.export import write_hf_folder
from plugtrain.commands.generate import load
from plugtrain.config import ModelConfig
from plugtrain.data import Tokenizer
from plugtrain.errors import CheckpointError, ConfigError
from plugtrain.model import LLAMA, Transformer, from_hf, model_args_from_hf, read_hf_config
from plugtrain.testing import (
    HF_VARIANTS,
    hf_llama_folder,
    hf_llama_logits,
    hf_tensors,
    make_trainer,
)

pytest.importorskip("transformers")

SHARD = 300_000
"""Bytes: the plain variant is saved in shards of at most this, with an index file."""


def _import(folder: Path, *, permute: bool = True, scaling: bool = True) -> Transformer:
    """plugtrain's model holding the folder's weights; ``permute=False`` and ``scaling=False``
    leave out the q/k permutation and the RoPE scaling (negative controls)."""
    args = model_args_from_hf(read_hf_config(folder))
    if not scaling:
        args = dataclasses.replace(args, rope_scaling=None)
    model = Transformer(args)
    model.load_state_dict(
        dict(from_hf(k, v, args, permute=permute) for k, v in hf_tensors(folder).items())
    )
    return model.eval()


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    """Two sequences of 128 tokens of the sample's validation text."""
    tokenizer = Tokenizer.from_file(sample.resolve("sample:tokenizer.json"))
    text = " ".join(
        json.loads(line)["text"] for line in sample.resolve("sample:validation.jsonl").open()
    )
    ids = torch.tensor(tokenizer.encode(text)[: 2 * 128])
    return ids.view(2, 128)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokens) -> dict[str, dict]:
    """Each variant's folder, transformers' logits, the import and its errors."""
    out = {}
    for variant in HF_VARIANTS:
        folder = tmp_path_factory.mktemp(variant)
        hf_llama_folder(folder, variant, max_shard_size=SHARD if variant == "plain" else None)
        expected = hf_llama_logits(folder, tokens)
        with torch.no_grad():

            def error(**kwargs: bool) -> float:
                return (_import(folder, **kwargs)(tokens) - expected).abs().max().item()  # noqa: B023

            errors = {"import": error(), "no permutation": error(permute=False)}
            if variant == "scaled":
                errors["no scaling"] = error(scaling=False)
        out[variant] = {"folder": folder, "logits": expected, "errors": errors}
    return out


def test_the_plain_folder_is_sharded_and_the_tied_one_has_no_lm_head(folders):
    plain, tied = folders["plain"]["folder"], folders["tied"]["folder"]
    assert (plain / "model.safetensors.index.json").is_file()
    assert len(list(plain.glob("model-*.safetensors"))) > 1
    assert "lm_head.weight" in hf_tensors(plain) and "lm_head.weight" not in hf_tensors(tied)
    assert model_args_from_hf(read_hf_config(tied)).tie_embeddings


@pytest.mark.parametrize("variant", HF_VARIANTS)
def test_the_import_gives_transformers_logits_and_the_controls_do_not(folders, variant):
    errors = folders[variant]["errors"]
    assert errors["import"] < 1e-5
    assert errors["no permutation"] > 1e-5
    if variant == "scaled":
        assert errors["no scaling"] > 1e-5


@pytest.mark.parametrize("variant", HF_VARIANTS)
def test_import_then_export_gives_the_tensors_back_bitwise(folders, tokens, tmp_path, variant):
    folder = folders[variant]["folder"]
    model = _import(folder)
    state = model.state_dict()
    out = write_hf_folder(
        tmp_path / "export",
        model.args,
        state.__getitem__,
        hf=LLAMA.hf,
        tokenizer_path=folder / "tokenizer.json",
        dtype=torch.float32,
        max_shard_size=SHARD,
    )
    theirs, ours = hf_tensors(folder), hf_tensors(out)
    assert list(ours) == [k for k in ours if k in theirs] and ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    config, original = read_hf_config(out), read_hf_config(folder)
    assert config["tie_word_embeddings"] is (variant == "tied")
    scaling = original.get("rope_parameters", {})
    expected = (
        None
        if variant != "scaled"
        else {k: scaling[k] for k in ("rope_type", "factor", "low_freq_factor", "high_freq_factor")}
        | {"original_max_position_embeddings": scaling["original_max_position_embeddings"]}
    )
    assert config["rope_scaling"] == expected
    assert model_args_from_hf(config) == model.args
    assert torch.equal(hf_llama_logits(out, tokens), folders[variant]["logits"])


def test_generate_loads_a_tied_scaled_folder(folders, tokens, tmp_path):
    folder = hf_llama_folder(tmp_path, "scaled", tie_word_embeddings=True)
    model, _ = load(folder)
    with torch.no_grad():
        error = (model(tokens) - hf_llama_logits(folder, tokens)).abs().max().item()
    assert error < 1e-5 and model.output is None and model.args.rope_scaling is not None


def test_flavor_hf_takes_the_shape_and_vocabulary_of_config_json(folders, tmp_path):
    folder = folders["tied"]["folder"]
    expected = dataclasses.replace(model_args_from_hf(read_hf_config(folder)), max_seq_len=512)
    model = ModelConfig(flavor="hf", hf_config=str(folder))
    assert model.model_args(2000, 512) == expected  # a smaller tokenizer fits
    with pytest.raises(ConfigError, match="the tokenizer has 4096 tokens, more than the 2048"):
        model.model_args(4096, 32)
    trainer = make_trainer(
        tmp_path, "--model.flavor", "hf", "--model.hf_config", str(folder / "config.json")
    )
    assert trainer.model_args == dataclasses.replace(expected, max_seq_len=256)
    assert trainer.model.output is None


def test_a_missing_or_damaged_config_json_is_one_line(tmp_path):
    with pytest.raises(CheckpointError, match=r"cannot read Hugging Face config .*config\.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"give a config\.json or the folder holding it"):
        read_hf_config(tmp_path)
    with pytest.raises(CheckpointError, match=r"config\.json has no field 'hidden_size'"):
        model_args_from_hf({"model_type": "llama"})


def test_a_tied_config_with_an_lm_head_is_refused(folders):
    args = model_args_from_hf(read_hf_config(folders["tied"]["folder"]))
    with pytest.raises(CheckpointError, match=r"tensor 'lm_head\.weight' is in the folder, but"):
        from_hf("lm_head.weight", torch.zeros(args.vocab_size, args.dim), args)
