"""The model-family seam: ``[model] family`` finds a ``ModelSpec``, and the run takes its parts
from it (a toy family registered here builds, initialises and estimates the model it trains)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from plugtrain.config import build_config, format_help, merged_values, parse_command_line
from plugtrain.errors import CheckpointError, ConfigError
from plugtrain.model import (
    FAMILIES,
    FLAVORS,
    LLAMA,
    ModelSpec,
    Transformer,
    hf_model_spec,
    model_spec,
)
from plugtrain.testing import make_trainer, read_metrics, tiny_run


def test_the_default_family_is_llama_and_help_shows_the_key():
    config = build_config(merged_values(parse_command_line([])), {}, ())
    assert config.model.family == "llama"
    assert model_spec(config.model.family) is LLAMA
    assert isinstance(LLAMA, ModelSpec) and LLAMA.flavors is FLAVORS
    lines = format_help({}).splitlines()
    at = lines.index("  --model.family (one of 'llama', 'moe'; default 'llama')")
    assert lines[at + 1].split()[:3] == ["The", "model", "family"]


@pytest.mark.parametrize(
    ("family", "message"),
    [
        (
            "lama",
            "config key 'model.family' is 'lama' (did you mean 'llama'?); choose one of llama, moe",
        ),
        ("gpt", "config key 'model.family' is 'gpt'; choose one of llama, moe"),
    ],
)
def test_an_unknown_family_is_refused_in_one_line(family, message):
    with pytest.raises(ConfigError) as e:
        build_config(merged_values(parse_command_line(["--model.family", family])), {}, ())
    assert str(e.value) == message
    with pytest.raises(ConfigError) as e:
        model_spec(family)
    assert str(e.value) == message


def test_a_config_json_finds_its_family_by_model_type():
    assert hf_model_spec({"model_type": "llama"}) is LLAMA
    with pytest.raises(CheckpointError) as e:
        hf_model_spec({"model_type": "mistral"})
    assert str(e.value) == (
        "config.json field 'model_type' is 'mistral', which no model family reads: give the "
        "config of one of llama, qwen3_moe"
    )


class ToyTransformer(Transformer):
    """Llama's model under another family's name: the run must build this class."""


def _zeros(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return t.zero_()


def test_a_registered_family_builds_initialises_and_estimates_the_run(tmp_path, monkeypatch):
    used: list[str] = []

    def init_plan(model):
        used.append("init_plan")
        # Every weight zero: the logits are all 0, the first loss exactly log(vocab).
        return [(param, _zeros) for param in model.parameters()]

    def memory(args, **kwargs):
        used.append("memory")
        return LLAMA.memory(args, **kwargs)

    toy = dataclasses.replace(
        LLAMA,
        name="toy",
        flavors={"tiny": FLAVORS["tiny"]},
        build=ToyTransformer,
        init_plan=init_plan,
        memory=memory,
    )
    monkeypatch.setitem(FAMILIES, "toy", lambda: toy)
    trainer = make_trainer(tmp_path / "toy", "--model.family", "toy", steps=1)
    trainer.run()
    assert type(trainer.model) is ToyTransformer
    assert used == ["init_plan", "memory"]
    log_vocab = math.log(trainer.model_args.vocab_size)
    assert read_metrics(tmp_path / "toy")[0]["loss"] == pytest.approx(log_vocab, abs=1e-5)
    llama = tiny_run(tmp_path / "llama", steps=1)  # the control: Llama's own init plan
    assert abs(llama.losses[1] - log_vocab) > 1e-2
