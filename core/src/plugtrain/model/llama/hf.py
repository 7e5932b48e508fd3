"""The Llama family's Hugging Face format: its config.json and its tensor names.

Both directions, one tensor at a time, so that an export streams and an import can read only
what it needs. The only change besides the names is RoPE's layout: plugtrain (Meta's reference
code) rotates adjacent channel pairs ``(2k, 2k+1)`` of each head, Hugging Face's Llama the pairs
``(k, k + head_dim/2)`` (rotate-half). The same model in the other layout has the rows of
``wq`` and ``wk`` permuted within each head; without the permutation it loads, runs and gives
slightly wrong logits (:func:`to_hf`'s ``permute``).

config.json is written in the legacy form (top-level ``rope_theta``, ``rope_scaling``,
``torch_dtype``) that transformers 4 and 5 and other readers (vLLM, llama.cpp's converter) all
read; both forms are read. A model with tied embeddings has no ``output.weight``, and its folder
no ``lm_head.weight`` (as transformers saves a tied model).
"""

from __future__ import annotations

from typing import Any

import torch

from plugtrain.errors import CheckpointError, one_line
from plugtrain.model.llama.args import ModelArgs, RopeScaling

__all__ = [
    "decoder_config",
    "from_hf",
    "hf_config",
    "hf_rope_rows",
    "meta_rope_rows",
    "model_args_from_hf",
    "parameter_shapes",
    "refuse_field",
    "rope_from_hf",
    "to_hf",
]

_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
"""plugtrain's name -> Hugging Face's, inside ``layers.N.`` / ``model.layers.N.``, in the
order of the block's parameters."""
_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_FROM_LAYER = {hf: ours for ours, hf in _LAYER_NAMES.items()}
_FROM_TOP = {hf: ours for ours, hf in _TOP_NAMES.items()}


def decoder_config(
    args: Any, *, dtype: torch.dtype, bos_token_id: int | None, eos_token_id: int | None
) -> dict[str, Any]:
    """The config.json fields a Llama-style decoder of shape ``args`` (a family's args with
    :class:`ModelArgs`'s fields) stored in ``dtype`` shares with the formats built on it
    (Qwen3-MoE's): sizes, heads, norms, RoPE, tokens, dtype."""
    scaling = args.rope_scaling
    return {
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None
        if scaling is None
        else {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len,
        },
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def hf_config(
    args: ModelArgs, *, dtype: torch.dtype, bos_token_id: int | None, eos_token_id: int | None
) -> dict[str, Any]:
    """config.json of ``LlamaForCausalLM`` for a model of shape ``args`` stored in ``dtype``."""
    tokens = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **decoder_config(args, dtype=dtype, **tokens),
        "mlp_bias": False,
    }


def refuse_field(field: str, value: Any, why: str) -> CheckpointError:
    """The one-line error for config.json field ``field``, of ``value``, which the model
    cannot express because ``why``."""
    return CheckpointError(
        f"config.json field '{field}' is {value!r}, which plugtrain's model cannot express: {why}"
    )


_LLAMA3_KEYS = {
    "factor": "factor",
    "low_freq_factor": "low_freq_factor",
    "high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "original_max_seq_len",
}
"""Hugging Face's llama3 RoPE parameters -> :class:`RopeScaling`'s fields."""


def rope_from_hf(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE's theta and scaling, from the legacy form (top-level ``rope_theta``,
    ``rope_scaling``) or transformers 5's (``rope_parameters`` holding both)."""
    field = "rope_scaling" if config.get("rope_scaling") is not None else "rope_parameters"
    params = config.get(field) or {}
    if not isinstance(params, dict):
        raise refuse_field(field, params, "it must be an object")
    theta = float(config.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise refuse_field(field, params, "only the default RoPE and the llama3 scaling are")
    missing = [key for key in _LLAMA3_KEYS if key not in params]
    if missing:
        raise refuse_field(field, params, f"the llama3 scaling needs '{missing[0]}'")
    try:
        return theta, RopeScaling(**{ours: params[hf] for hf, ours in _LLAMA3_KEYS.items()})
    except (TypeError, ValueError) as e:
        raise refuse_field(field, params, one_line(e)) from e


_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)
"""The fields of config.json without a default."""


def model_args_from_hf(config: dict[str, Any]) -> ModelArgs:
    """The :class:`ModelArgs` of a ``LlamaForCausalLM`` config.json (legacy or transformers 5
    form); a one-line :class:`CheckpointError` naming the field it cannot express."""
    for field, wanted, why in (
        ("model_type", "llama", "only Llama models are supported"),
        ("hidden_act", "silu", "the feed-forward network is SwiGLU"),
        ("attention_bias", False, "attention projections have no bias"),
        ("mlp_bias", False, "feed-forward projections have no bias"),
        ("attention_dropout", 0.0, "the model has no dropout"),
    ):
        value = config.get(field, wanted if field != "model_type" else None)
        if value != wanted:
            raise refuse_field(field, value, why)
    if config.get("architectures", ["LlamaForCausalLM"]) != ["LlamaForCausalLM"]:
        raise refuse_field("architectures", config["architectures"], "only LlamaForCausalLM is")
    if config.get("sliding_window") is not None:
        raise refuse_field("sliding_window", config["sliding_window"], "attention is global")
    if not isinstance(config.get("tie_word_embeddings", False), bool):
        raise refuse_field(
            "tie_word_embeddings", config["tie_word_embeddings"], "it must be a bool"
        )
    theta, scaling = rope_from_hf(config)
    if config.get("pretraining_tp", 1) != 1:
        raise refuse_field("pretraining_tp", config["pretraining_tp"], "use a config with 1")
    missing = [field for field in _REQUIRED if field not in config]
    if missing:
        raise CheckpointError(
            f"config.json has no field '{missing[0]}': give the config of a LlamaForCausalLM"
        )
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    try:
        if (config.get("head_dim") or dim // n_heads) * n_heads != dim:
            raise refuse_field("head_dim", config["head_dim"], "it must be hidden_size // heads")
        args = ModelArgs(
            dim=dim,
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            vocab_size=config["vocab_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_seq_len=config.get("max_position_embeddings", 2048),
            ffn_dim=config["intermediate_size"],
            tie_embeddings=config.get("tie_word_embeddings", False),
            rope_scaling=scaling,
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json describes an unusable model: {one_line(e)}") from e
    return args


def parameter_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``Transformer(args)`` by plugtrain's name, in the model's order."""
    d, hd, hidden = args.dim, args.head_dim, args.ffn_hidden_dim
    layer = dict(
        zip(
            _LAYER_NAMES,
            [
                (d,),
                (args.n_heads * hd, d),
                (args.n_kv_heads * hd, d),
                (args.n_kv_heads * hd, d),
                (d, args.n_heads * hd),
                (d,),
                (hidden, d),
                (d, hidden),
                (hidden, d),
            ],
            strict=True,
        )
    )
    shapes = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in layer.items()})
    shapes["norm.weight"] = (d,)
    if not args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, d)
    return shapes


def _heads(name: str, args: ModelArgs) -> int | None:
    """Number of heads whose rows ``name`` (plugtrain's) holds, if RoPE rotates them."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def hf_rope_rows(tensor: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """``tensor``'s rows (``heads`` heads of ``head_dim``) from Meta's RoPE pairs ``(2k,
    2k+1)`` to rotate-half's ``(k, k + head_dim/2)``, within each head."""
    rows = tensor.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2)
    return rows.reshape(tensor.shape)


def meta_rope_rows(tensor: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`hf_rope_rows`: rotate-half's rows back in Meta's pairs."""
    rows = tensor.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2)
    return rows.reshape(tensor.shape)


def _unknown(name: str, side: str) -> CheckpointError:
    return CheckpointError(
        f"tensor '{name}' has no place in the Hugging Face Llama format ({side} names only "
        "the parameters of plugtrain's Transformer): export a model without it"
    )


def to_hf(
    name: str, tensor: torch.Tensor, args: ModelArgs, *, permute: bool = True
) -> tuple[str, torch.Tensor]:
    """plugtrain parameter ``name`` (``layers.0.attention.wq.weight``) and its full tensor as
    Hugging Face's name and tensor; ``permute=False`` leaves q/k rows in plugtrain's RoPE layout
    (wrong: only to show that a test can see the difference)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name], tensor
    prefix, _, rest = name.partition(".")
    index, _, inner = rest.partition(".")
    if prefix != "layers" or not index.isdigit() or inner not in _LAYER_NAMES:
        raise _unknown(name, "plugtrain")
    heads = _heads(name, args)
    if heads is not None and permute:
        tensor = hf_rope_rows(tensor, heads, args.head_dim)
    return f"model.layers.{index}.{_LAYER_NAMES[inner]}", tensor


def from_hf(
    name: str, tensor: torch.Tensor, args: ModelArgs, *, permute: bool = True
) -> tuple[str, torch.Tensor]:
    """The inverse of :func:`to_hf`: Hugging Face's name and tensor as plugtrain's."""
    if name == "lm_head.weight" and args.tie_embeddings:
        raise CheckpointError(
            "tensor 'lm_head.weight' is in the folder, but its config.json sets "
            "tie_word_embeddings: the model has no separate output projection; set it to false"
        )
    if name in _FROM_TOP:
        return _FROM_TOP[name], tensor
    parts = name.split(".", 3)
    if len(parts) != 4 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        raise _unknown(name, "Hugging Face")
    if parts[3] not in _FROM_LAYER:
        raise _unknown(name, "Hugging Face")
    ours = f"layers.{parts[2]}.{_FROM_LAYER[parts[3]]}"
    heads = _heads(ours, args)
    if heads is not None and permute:
        tensor = meta_rope_rows(tensor, heads, args.head_dim)
    return ours, tensor
