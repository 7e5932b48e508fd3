"""The moe family: routing against a per-token loop, the model, its shape arithmetic, its runs
and the bad input it refuses."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from plugtrain.cli import main
from plugtrain.config import ModelConfig
from plugtrain.errors import CheckpointError, ConfigError
from plugtrain.model import MOE, Checkpointing, model_spec
from plugtrain.model.moe import FLAVORS, MoE, MoEArgs, MoETransformer, moe_layers
from plugtrain.testing import make_trainer, read_metrics, tiny_args

DEBUG = FLAVORS["debug_moe"]


def per_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """``moe``'s output written out token by token: softmax, top-k of probs + bias, the
    picked probabilities renormalised, each picked expert's SwiGLU weighted and summed."""
    out = torch.zeros_like(x)
    experts = moe.experts
    for t, row in enumerate(x):
        probs = F.linear(row, moe.router.gate.weight).float().softmax(-1)
        picked = (probs + moe.router.expert_bias).topk(moe.top_k).indices
        weights = probs[picked] / probs[picked].sum()
        for e, w in zip(picked.tolist(), weights, strict=True):
            hidden = F.silu(experts.w1[e] @ row) * (experts.w3[e] @ row)
            out[t] += w * (experts.w2[e] @ hidden)
    return out


def _moe(seed: int = 0, **kwargs) -> MoE:
    torch.manual_seed(seed)
    return MoE(dim=16, num_experts=8, top_k=2, hidden=32, **kwargs)


def test_the_mixture_equals_its_per_token_loop_and_counts_its_tokens():
    moe = _moe()
    x = torch.randn(24, 16)
    torch.testing.assert_close(moe(x), per_token(moe, x), rtol=1e-5, atol=1e-6)
    assert moe.stats is not None and moe.stats.counts.sum() == 24 * 2
    assert torch.equal(moe.tokens_per_expert, moe.stats.counts)
    moe.eval()
    moe(x)
    assert moe.stats is None and moe.tokens_per_expert.sum() == 48  # training forwards only


def test_a_recomputed_forward_counts_nothing_again():
    moe = _moe()
    x = torch.randn(10, 16, requires_grad=True)
    with set_checkpoint_early_stop(False):  # the whole forward again in the backward
        checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.tokens_per_expert.sum() == 20 and moe.stats.counts.sum() == 20


def test_the_bias_moves_the_choice_and_not_the_weights():
    moe = _moe()
    x = torch.randn(24, 16)
    before = moe(x)
    moe.router.expert_bias[3] = 10.0  # every token picks expert 3
    after = moe(x)
    assert not torch.allclose(before, after)
    assert moe.stats.counts[3] == 24
    torch.testing.assert_close(after, per_token(moe, x), rtol=1e-5, atol=1e-6)


def test_without_renormalisation_the_weights_are_the_probabilities():
    moe = _moe(norm_topk_prob=False)
    x = torch.randn(5, 16)
    probs = moe.router.gate(x).float().softmax(-1)
    _, _, experts, weights = moe.router(x)
    assert torch.equal(weights, probs.gather(-1, experts))


def test_a_shared_expert_adds_its_swiglu_for_every_token():
    moe = _moe(shared_hidden=24)
    x = torch.randn(6, 16)
    shared = moe.shared_experts
    torch.testing.assert_close(moe(x), per_token(moe, x) + shared(x), rtol=1e-5, atol=1e-6)


def test_the_experts_are_called_once_with_tokens_sorted_by_expert(monkeypatch):
    moe = _moe()
    calls = []
    real = moe.experts.forward
    monkeypatch.setattr(
        moe.experts, "forward", lambda x, counts: calls.append(counts.clone()) or real(x, counts)
    )
    moe(torch.randn(2, 5, 16))
    assert len(calls) == 1 and calls[0].sum() == 20


def test_the_model_builds_from_the_spec_and_counts_its_parameters():
    args = dataclasses.replace(DEBUG, mlp_only_layers=(0,), ffn_dim=48, shared_ffn_dim=16)
    model = MOE.build(args)
    assert isinstance(model, MoETransformer) and model_spec("moe") is MOE
    assert model.layers["0"].moe is None and model.layers["1"].moe is not None
    assert sum(p.numel() for p in model.parameters()) == args.num_params()
    init = MOE.init_plan(model)
    assert len(init) == len(list(model.parameters()))
    model.init_weights(0)
    tokens = torch.randint(0, args.vocab_size, (2, 12))
    # Decoding reuses Llama's KV cache: a prefill then one step give the full forward's logits.
    model.eval()
    with torch.no_grad():
        full = model(tokens)
        cache = model.kv_cache(2, 12)
        model(tokens[:, :11], cache)
        last = model(tokens[:, 11:], cache)
    torch.testing.assert_close(last[:, 0], full[:, 11], rtol=1e-4, atol=1e-5)


def test_qwen3_30b_a3b_has_its_parameters_and_counts_active_flops():
    args = FLAVORS["qwen3_30b_a3b"]
    assert round(args.num_params() / 1e9, 2) == 30.53
    assert round(args.num_params(active=True) / 1e9, 2) == 3.35
    active = args.num_params(exclude_embedding=True, active=True)
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 4096
    assert args.flops_per_token(4096) == 6 * active + attention
    # The GEMMs add up to the FLOPs but the norms' 6 per weight per token.
    rows, seq = 2, 4096
    gemm_flops = sum(g.flops for g in args.gemms(rows, seq))
    norms = args.n_layers * (2 * args.dim + 2 * args.head_dim) + args.dim
    assert gemm_flops == (args.flops_per_token(seq) - 6 * norms) * rows * seq


def test_the_estimate_holds_every_expert_and_the_active_activations():
    args = dataclasses.replace(FLAVORS["qwen3_30b_a3b"], max_seq_len=4096)
    estimate = MOE.memory(
        args, world_size=8, microbatch=1, seq_len=4096, param_dtype="bfloat16",
        reduce_dtype="float32", checkpointing=Checkpointing("full"),
    )  # fmt: skip
    parts = {name: nbytes for name, nbytes, _ in estimate.parts}
    assert parts["parameters"] == -(-args.num_params() // 8) * 4  # all 128 experts, sharded
    assert parts["optimizer"] == 2 * parts["parameters"]
    assert 60 < estimate.total / 2**30 < 80  # an 80 GB GPU each, at full checkpointing


def test_a_debug_moe_run_logs_each_blocks_load(tmp_path):
    trainer = make_trainer(
        tmp_path, "--model.family", "moe", "--model.flavor", "debug_moe",
        "--metrics.moe_tokens_per_expert", "true",
    )  # fmt: skip
    trainer.train()
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)
    mean = 4 * 32 * DEBUG.top_k / DEBUG.num_experts  # a step's token copies over the experts
    for record in records:
        for block in range(DEBUG.n_layers):
            high, low = record[f"moe/max_tokens.{block}"], record[f"moe/min_tokens.{block}"]
            assert record[f"moe/imbalance.{block}"] == pytest.approx(high / mean)
            assert 0 <= low <= mean <= high
            experts = [record[f"moe/tokens_per_expert.{block}.{e}"] for e in range(8)]
            assert sum(experts) == 8 * mean and (min(experts), max(experts)) == (low, high)
        assert record["moe/imbalance"] == max(record[f"moe/imbalance.{b}"] for b in (0, 1))
    assert "moe/aux_loss" not in records[0]  # the losses are off by default
    assert all(m.tokens_per_expert.sum() == 0 for m in moe_layers(trainer.model))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--model.family", "moe", "--model.flavor", "debug_moe", "--model.moe_top_k", "9"],
            "config key 'model.moe_top_k' gives top-k 9 over 8 experts: a token cannot be "
            "routed to more experts than there are; lower model.moe_top_k or raise "
            "model.moe_experts",
        ),
        (
            ["--model.flavor", "debug_moe"],
            "config key 'model.flavor' is 'debug_moe', a flavor of family 'moe', but "
            "model.family is 'llama': set model.family = \"moe\"",
        ),
        (
            ["--model.family", "moe", "--model.flavor", "debug"],
            "config key 'model.flavor' is 'debug', a flavor of family 'llama', but "
            "model.family is 'moe': set model.family = \"llama\"",
        ),
        (
            ["--model.moe_top_k", "2"],
            "config key 'model.moe_top_k' is 2, but model.family is 'llama', which has no "
            'experts: set model.family = "moe" or leave it unset',
        ),
    ],
)
def test_bad_moe_settings_are_one_line_and_exit_2(tmp_path, capsys, extra, message):
    assert main(["train", *tiny_args(tmp_path, *extra)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def test_tensor_parallelism_is_refused_in_one_line():
    MOE.check_parallel(DEBUG, 1, 32)
    with pytest.raises(ConfigError) as e:
        MOE.check_parallel(DEBUG, 2, 32)
    assert str(e.value) == (
        "parallelism.tp = 2, but model.family 'moe' has no tensor parallelism yet: set "
        "parallelism.tp = 1 (shard the model with dp_shard)"
    )


def test_args_refuse_top_k_over_the_experts():
    with pytest.raises(ValueError, match="top_k=3 exceeds num_experts=2"):
        MoEArgs(dim=8, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=4, num_experts=2,
                top_k=3, moe_ffn_dim=8)  # fmt: skip
    with pytest.raises(ConfigError, match="moe_experts"):
        ModelConfig(family="moe", flavor="debug_moe", moe_experts=-1)


def test_activation_checkpointing_changes_neither_the_losses_nor_the_loads(tmp_path):
    args = ("--model.family", "moe", "--model.flavor", "debug_moe",
            "--model.moe_bias_update_rate", "0.01")  # fmt: skip
    runs = []
    for i, extra in enumerate(([], ["--plugins.enabled", "activation_checkpointing"])):
        make_trainer(tmp_path / str(i), *args, *extra, steps=2).train()
        records = [r for r in read_metrics(tmp_path / str(i)) if "loss" in r]
        runs.append([(r["loss"], r["moe/max_tokens.1"], r["moe/min_tokens.0"]) for r in records])
    assert runs[0] == runs[1]


QWEN3_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 2048,
}  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"num_experts_per_tok": 9},
            "config.json describes an unusable model: ValueError: MoEArgs.top_k=9 exceeds "
            "num_experts=8: a token cannot be routed to more experts than there are; lower top_k",
        ),
        (
            {"model_type": "llama"},
            "config.json field 'model_type' is 'llama', which plugtrain's model cannot express: "
            "only Qwen3-MoE models are supported by family 'moe'",
        ),
        (
            {"use_sliding_window": True},
            "config.json field 'use_sliding_window' is True, which plugtrain's model cannot "
            "express: attention is global",
        ),
        (
            {"num_experts": None},
            "config.json has no field 'num_experts': give the config of a Qwen3MoeForCausalLM",
        ),
        (
            {"mlp_only_layers": [0]},
            "config.json describes an unusable model: ValueError: MoEArgs: block 0 is dense "
            "(mlp_only_layers, decoder_sparse_step) but ffn_dim is None: set ffn_dim >= 1",
        ),
    ],
)
def test_a_qwen3_moe_config_the_model_cannot_express_is_one_line(changes, message):
    config = {k: v for k, v in (QWEN3_MOE | changes).items() if v is not None}
    with pytest.raises(CheckpointError) as e:
        MOE.hf.args_from_hf(config)
    assert str(e.value) == message
    args = MOE.hf.args_from_hf(QWEN3_MOE | {"num_local_experts": 8})
    assert (args.num_experts, args.top_k, args.head_dim, args.ffn_dim) == (8, 2, 32, None)
    assert MOE.hf.args_from_hf(MOE.hf.hf_config(
        args, dtype=torch.float32, bos_token_id=None, eos_token_id=None)) == args  # fmt: skip
