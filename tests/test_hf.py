"""The Hugging Face Llama format (plugtrain.model.llama.hf) against transformers' own model."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from plugtrain.errors import CheckpointError
from plugtrain.model import FLAVORS, Transformer, cross_entropy
from plugtrain.model.llama.hf import from_hf, hf_config, model_args_from_hf, parameter_shapes, to_hf
from plugtrain.testing import document_spans, packed_documents

transformers = pytest.importorskip("transformers")

TINY = FLAVORS["tiny"]


def test_names_and_shapes_are_those_of_transformers_llama():
    config = transformers.LlamaConfig(
        **hf_config(TINY, dtype=torch.float32, bos_token_id=0, eos_token_id=1)
    )
    theirs = {
        k: tuple(v.shape) for k, v in transformers.LlamaForCausalLM(config).state_dict().items()
    }
    ours = Transformer(TINY).state_dict()
    assert list(parameter_shapes(TINY)) == list(ours)
    converted = {to_hf(k, v, TINY)[0]: tuple(v.shape) for k, v in ours.items()}
    assert converted == theirs


def test_to_hf_then_from_hf_is_the_identity_and_permutes_only_q_and_k():
    model = Transformer(TINY)
    model.init_weights(0)
    for name, tensor in model.state_dict().items():
        hf_name, hf_tensor = to_hf(name, tensor, TINY)
        back_name, back = from_hf(hf_name, hf_tensor, TINY)
        assert back_name == name
        assert torch.equal(back, tensor)
        permuted = name.endswith(("wq.weight", "wk.weight"))
        assert torch.equal(hf_tensor, tensor) != permuted, name
        assert torch.equal(to_hf(name, tensor, TINY, permute=False)[1], tensor)


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_model_args_from_hf_inverts_hf_config(flavor):
    args = dataclasses.replace(FLAVORS[flavor], vocab_size=1000)
    config = hf_config(args, dtype=torch.bfloat16, bos_token_id=None, eos_token_id=1)
    back = model_args_from_hf(config)
    assert hf_config(back, dtype=torch.bfloat16, bos_token_id=None, eos_token_id=1) == config
    assert parameter_shapes(back) == parameter_shapes(args)


def test_model_args_from_hf_reads_the_transformers_5_form():
    config = transformers.LlamaConfig(
        **hf_config(TINY, dtype=torch.float32, bos_token_id=0, eos_token_id=1)
    )
    saved = config.to_dict()
    assert "rope_theta" not in saved and saved["rope_parameters"]["rope_theta"] == TINY.rope_theta
    back = model_args_from_hf(saved)
    assert parameter_shapes(back) == parameter_shapes(TINY)
    assert back.rope_theta == TINY.rope_theta and back.norm_eps == TINY.norm_eps


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model_type", "mistral"),
        ("attention_bias", True),
        ("mlp_bias", True),
        ("tie_word_embeddings", "yes"),
        ("attention_dropout", 0.1),
        ("pretraining_tp", 2),
        ("sliding_window", 4096),
        ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}),
        (
            "rope_scaling",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 64,
            },
        ),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}),
        ("hidden_act", "gelu"),
        ("architectures", ["MistralForCausalLM"]),
        ("head_dim", 16),
    ],
)
def test_model_args_from_hf_refuses_what_the_model_cannot_express(field, value):
    config = {**hf_config(TINY, dtype=torch.float32, bos_token_id=0, eos_token_id=1), field: value}
    with pytest.raises(CheckpointError, match=f"config.json field '{field}' is ") as e:
        model_args_from_hf(config)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "name", ["layers.0.attention.wq.bias", "extra.weight", "layers.x.ffn_norm.weight"]
)
def test_to_hf_refuses_a_tensor_the_format_has_no_place_for(name):
    with pytest.raises(CheckpointError, match=f"tensor '{re.escape(name)}' has no place"):
        to_hf(name, torch.zeros(2), TINY)
    with pytest.raises(
        CheckpointError, match=r"tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"
    ):
        from_hf("model.layers.0.self_attn.q_proj.bias", torch.zeros(2), TINY)


def test_a_transformers_model_read_with_from_hf_gives_its_logits():
    """The import direction on its own: a random LlamaForCausalLM's weights, renamed and
    permuted by from_hf, give plugtrain's model the same logits (and without the permutation
    they do not)."""
    config = transformers.LlamaConfig(
        **hf_config(TINY, dtype=torch.float32, bos_token_id=0, eos_token_id=1)
    )
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    args = model_args_from_hf(config.to_dict())
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len))
    with torch.no_grad():
        expected = theirs(tokens).logits
    errors = {}
    for permute in (True, False):
        ours = Transformer(args)
        ours.init_weights(0)  # the RoPE table; every parameter is then loaded
        state = dict(from_hf(k, v, args, permute=permute) for k, v in theirs.state_dict().items())
        ours.load_state_dict(state)
        with torch.no_grad():
            errors[permute] = (ours(tokens) - expected).abs().max().item()
    assert errors[True] < 1e-5 < errors[False]


@torch.no_grad()
def test_transformers_on_each_document_alone_gives_the_packed_and_masked_loss():
    """The judge of document masking: LlamaForCausalLM on each document on its own (positions
    from 0) gives the loss plugtrain's packed row gives it with masking and reset positions."""
    args = dataclasses.replace(TINY, attention="document")
    config = transformers.LlamaConfig(
        **hf_config(args, dtype=torch.float32, bos_token_id=0, eos_token_id=1)
    )
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).eval()
    ours = Transformer(args)
    ours.init_weights(0)
    ours.load_state_dict(dict(from_hf(k, v, args) for k, v in theirs.state_dict().items()))
    batch = packed_documents([(5, 11, 8), (13, 2, 9)], args.vocab_size)
    logits = ours(batch.inputs, **batch.model_inputs())
    for row, documents in enumerate(batch.documents):
        for span in document_spans(documents):
            targets = batch.targets[row, span][None]
            expected = cross_entropy(theirs(batch.inputs[row, span][None]).logits, targets)
            assert abs(cross_entropy(logits[row, span][None], targets) - expected) < 1e-5
