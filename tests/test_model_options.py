"""The model's options: tied embeddings, Llama 3.1's RoPE scaling and an exact FFN size."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open

from plugtrain.checkpoint import export_checkpoint, read_checkpoint
from plugtrain.commands.train import train
from plugtrain.config import JobConfig, ModelConfig
from plugtrain.errors import ConfigError
from plugtrain.model import (
    KVCache,
    RopeScaling,
    Transformer,
    read_hf_config,
    scale_rope_frequencies,
)
from plugtrain.model.llama.memory import _root_params
from plugtrain.model.llama.transformer import FLAVORS, precompute_freqs_cis
from plugtrain.testing import interrupted_and_resumed, tiny_args, tiny_run

TINY = FLAVORS["tiny"]
SCALING = RopeScaling(original_max_seq_len=16)
"""Llama 3.1's factors, over a context short enough that the tiny model's frequencies change."""
OPTIONS = (
    "--model.tie_embeddings", "true",
    "--model.rope_scaling", "llama3",
    "--model.rope_original_max_seq_len", "16",
)  # fmt: skip
"""The same options, for a run of the tiny model."""


def _model(**options: object) -> Transformer:
    model = Transformer(dataclasses.replace(TINY, **options))
    model.init_weights(0)
    return model


def test_a_tied_model_has_one_matrix_for_both_ends():
    tied, untied = _model(tie_embeddings=True), _model()
    assert tied.output is None
    assert list(untied.state_dict()) == [*tied.state_dict(), "output.weight"]
    args = tied.args
    assert args.num_params() == sum(p.numel() for p in tied.parameters())
    assert args.num_params() == untied.args.num_params() - args.vocab_size * args.dim
    assert args.flops_per_token(32) == untied.args.flops_per_token(32)  # the matmul stays
    assert _root_params(args) == args.vocab_size * args.dim + args.dim
    # Drawn once, at the output's scale, so that the initial logits have about unit scale.
    embedding = tied.tok_embeddings.weight
    assert embedding.std().item() == pytest.approx(args.dim**-0.5, rel=0.1)
    assert torch.equal(embedding, _model(tie_embeddings=True).tok_embeddings.weight)
    # The blocks draw what the untied model's draw.
    assert torch.equal(tied.layers["1"].attention.wq.weight, untied.layers["1"].attention.wq.weight)


def test_the_tied_gradient_is_the_sum_of_both_uses():
    tied, untied = _model(tie_embeddings=True), _model()
    untied.load_state_dict(
        {**tied.state_dict(), "output.weight": tied.tok_embeddings.weight.detach().clone()}
    )
    tokens = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = [model(tokens) for model in (tied, untied)]
    assert torch.equal(logits[0], logits[1])
    for out in logits:
        out.float().logsumexp(-1).mean().backward()
    both = untied.tok_embeddings.weight.grad + untied.output.weight.grad
    torch.testing.assert_close(tied.tok_embeddings.weight.grad, both, rtol=1e-5, atol=1e-7)


def test_rope_scaling_is_transformers_llama3():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim, theta = 32, 500000.0
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    llama3 |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig(
        hidden_size=2 * head_dim, num_attention_heads=2, rope_theta=theta, rope_scaling=llama3
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ours = scale_rope_frequencies(plain, RopeScaling(original_max_seq_len=64))
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)
    # Each regime is there: kept (high frequencies), interpolated, divided by the factor.
    ratio = ours / plain
    assert ratio[0] == 1 and ratio[-1] == pytest.approx(1 / 8)
    assert ((ratio > 1 / 8) & (ratio < 1)).any()
    unscaled = precompute_freqs_cis(head_dim, 64, theta)
    assert not torch.allclose(precompute_freqs_cis(head_dim, 64, theta, SCALING), unscaled)


def test_an_exact_ffn_dim_overrides_multiple_of():
    args = dataclasses.replace(TINY, ffn_dim=77)
    assert args.ffn_hidden_dim == 77
    assert Transformer(args).layers["0"].feed_forward.w1.weight.shape == (77, TINY.dim)
    with pytest.raises(ValueError, match="ffn_dim must be >= 1"):
        dataclasses.replace(TINY, ffn_dim=0)


def test_the_kv_cache_decodes_a_tied_scaled_model_as_one_forward():
    model = _model(tie_embeddings=True, rope_scaling=SCALING).eval()
    tokens = torch.randint(0, TINY.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    cache = KVCache(model.args, max_batch=2)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :30], cache)]
        steps += [model(tokens[:, i : i + 1], cache) for i in range(30, 40)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_the_config_keys_make_the_model_args():
    model = ModelConfig(
        flavor="tiny",
        tie_embeddings=True,
        rope_scaling="llama3",
        rope_original_max_seq_len=16,
        ffn_dim=40,
    )
    args = model.model_args(300, 128)
    assert args == dataclasses.replace(
        TINY, vocab_size=300, max_seq_len=128, tie_embeddings=True, ffn_dim=40, rope_scaling=SCALING
    )
    assert ModelConfig().model_args(300, 32) == dataclasses.replace(
        FLAVORS["debug"], vocab_size=300
    )


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"rope_scaling": "llama3", "rope_high_freq_factor": 0.5}, "'rope_scaling' is unusable"),
        ({"ffn_dim": 0}, "'ffn_dim' must be >= 1"),
        ({"hf_config": "x.json"}, "'hf_config' is set, but flavor is 'debug'"),
        ({"flavor": "hf", "hf_config": "x", "tie_embeddings": True}, "config.json sets the"),
    ],
)
def test_bad_model_keys_are_one_line(keys, message):
    with pytest.raises(ConfigError, match=message) as e:
        ModelConfig(**keys)
    assert "\n" not in str(e.value)


def test_flavor_hf_needs_a_config_json_or_an_hf_initial_load():
    with pytest.raises(ConfigError, match=r"'model\.hf_config' is empty") as e:
        JobConfig(model=ModelConfig(flavor="hf"))
    assert "checkpoint.initial_load_path" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("source", "wrong"),
    [
        ("nope-hf", "does not exist"),
        ("a_file", "is a file, not a folder"),
        ("empty", "has no config.json"),
        ("s3://bucket/hf", "is a URL, but flavor 'hf' reads config.json from a local folder"),
    ],
)
def test_flavor_hf_names_what_is_wrong_with_the_initial_load(tmp_path, capsys, source, wrong):
    """The folder the user named is the culprit, not the model.hf_config they left empty."""
    (tmp_path / "a_file").write_text("{}")
    (tmp_path / "empty").mkdir()
    path = source if "://" in source else str(tmp_path / source)
    dump = tmp_path / "run"
    argv = tiny_args(dump, "--model.flavor", "hf", "--checkpoint.initial_load_path", path)
    assert train(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"plugtrain: error: checkpoint.initial_load_path '{path}' {wrong}: ")
    assert "model.hf_config" in line and not dump.exists()


@pytest.mark.slow
def test_a_tied_scaled_run_under_fsdp2_resumes_exactly(tmp_path):
    """bfloat16 compute: FSDP2 shards the model even on one process, the tied matrix in the
    root's group; DCP saves it once and a stopped run resumes bit for bit."""
    bf16 = ("--training.mixed_precision_param", "bfloat16")
    result = interrupted_and_resumed(tmp_path, *OPTIONS, *bf16, steps=4, stop_after=2)
    assert result["stopped_at"] == result["step_at_resume"] == 2
    assert result["resumed"] == result["straight"]
    losses = {
        k: [(r["step"], r["loss"]) for r in result[f"{k}_metrics"] if "loss" in r]
        for k in ("straight", "resumed")
    }
    assert losses["resumed"] == losses["straight"] and len(losses["straight"]) == 4
    saved = read_checkpoint(tmp_path / "resumed" / "checkpoints" / "step-4", "model.")
    assert "model.tok_embeddings.weight" in saved and "model.output.weight" not in saved
    # export-hf writes it as transformers saves a tied, scaled model.
    out = tmp_path / "hf"
    export_checkpoint(tmp_path / "resumed", out, dtype=torch.float32)
    config = read_hf_config(out)
    assert config["tie_word_embeddings"] is True
    assert config["rope_scaling"]["original_max_position_embeddings"] == 16
    with safe_open(out / "model.safetensors", "pt") as f:
        names = list(f.keys())
        embedding = f.get_tensor("model.embed_tokens.weight")
    assert "lm_head.weight" not in names
    assert torch.equal(embedding, saved["model.tok_embeddings.weight"])


@pytest.mark.slow
def test_a_tied_scaled_run_compiles_and_checkpoints_activations_as_eager(tmp_path):
    plain = tiny_run(tmp_path / "plain", *OPTIONS, steps=2)
    both = (
        "--plugins.enabled",
        "compile,activation_checkpointing",
        "--compile.backend",
        "aot_eager",
    )
    wrapped = tiny_run(tmp_path / "wrapped", *OPTIONS, *both)
    assert list(wrapped.losses) == [1, 2, 3]
    for step, loss in plain.losses.items():
        assert wrapped.losses[step] == pytest.approx(loss, rel=1e-5), step
