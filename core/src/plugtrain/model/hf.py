"""The Hugging Face Llama format of plugtrain's model: its config.json and its tensor names.

Both directions, one tensor at a time, so that an export streams and an import can read only
what it needs. The only change besides the names is RoPE's layout: plugtrain (Meta's reference
code) rotates adjacent channel pairs ``(2k, 2k+1)`` of each head, Hugging Face's Llama the pairs
``(k, k + head_dim/2)`` (rotate-half). The same model in the other layout has the rows of
``wq`` and ``wk`` permuted within each head; without the permutation it loads, runs and gives
slightly wrong logits (:func:`to_hf`'s ``permute``).

config.json is written in the legacy form (top-level ``rope_theta``, ``torch_dtype``) that
transformers 4 and 5 and other readers (vLLM, llama.cpp's converter) all read.
"""

from __future__ import annotations

from typing import Any

import torch

from plugtrain.errors import CheckpointError
from plugtrain.model.transformer import ModelArgs

__all__ = ["from_hf", "hf_config", "model_args_from_hf", "parameter_shapes", "to_hf"]

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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_config(
    args: ModelArgs, *, dtype: torch.dtype, bos_token_id: int | None, eos_token_id: int | None
) -> dict[str, Any]:
    """config.json of ``LlamaForCausalLM`` for a model of shape ``args`` stored in ``dtype``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
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
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": _dtype_name(dtype),
    }


def _refuse(field: str, value: Any, why: str) -> CheckpointError:
    return CheckpointError(
        f"config.json field '{field}' is {value!r}, which plugtrain's model cannot express: {why}"
    )


def _ffn_args(dim: int, intermediate: int) -> dict[str, Any]:
    """``multiple_of`` and ``ffn_dim_multiplier`` whose ``ffn_hidden_dim`` is ``intermediate``."""
    base = int(2 * (4 * dim) / 3)
    if intermediate >= base:  # rounding base up to a multiple of intermediate gives it
        return {"multiple_of": intermediate, "ffn_dim_multiplier": None}
    # int(intermediate / base * base) is intermediate or intermediate - 1; either rounds up to it.
    return {"multiple_of": intermediate, "ffn_dim_multiplier": intermediate / base}


def model_args_from_hf(config: dict[str, Any]) -> ModelArgs:
    """The :class:`ModelArgs` of a ``LlamaForCausalLM`` config.json (legacy or transformers 5
    form); a one-line :class:`CheckpointError` naming the field it cannot express."""
    for field, wanted, why in (
        ("model_type", "llama", "only Llama models are supported"),
        ("hidden_act", "silu", "the feed-forward network is SwiGLU"),
        ("attention_bias", False, "attention projections have no bias"),
        ("mlp_bias", False, "feed-forward projections have no bias"),
        ("tie_word_embeddings", False, "the output projection is untied"),
    ):
        value = config.get(field, wanted if field != "model_type" else None)
        if value != wanted:
            raise _refuse(field, value, why)
    if config.get("architectures", ["LlamaForCausalLM"]) != ["LlamaForCausalLM"]:
        raise _refuse("architectures", config["architectures"], "only LlamaForCausalLM is")
    for field in ("sliding_window", "rope_scaling"):
        if config.get(field) is not None:
            raise _refuse(field, config[field], f"{field} is not implemented")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise _refuse("rope_parameters", rope, "only the default RoPE is implemented")
    if config.get("pretraining_tp", 1) != 1:
        raise _refuse("pretraining_tp", config["pretraining_tp"], "use a config with 1")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim", dim // n_heads) * n_heads != dim:
        raise _refuse("head_dim", config["head_dim"], "head_dim must be hidden_size // heads")
    try:
        args = ModelArgs(
            dim=dim,
            n_layers=config["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=config.get("num_key_value_heads") or n_heads,
            vocab_size=config["vocab_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_seq_len=config.get("max_position_embeddings", 2048),
            **_ffn_args(dim, config["intermediate_size"]),
        )
    except ValueError as e:
        raise CheckpointError(f"config.json describes an unusable model: {e}") from e
    if args.ffn_hidden_dim != config["intermediate_size"]:
        raise _refuse("intermediate_size", config["intermediate_size"], "no multiple_of gives it")
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
    shapes["output.weight"] = (args.vocab_size, d)
    return shapes


def _heads(name: str, args: ModelArgs) -> int | None:
    """Number of heads whose rows ``name`` (plugtrain's) holds, if RoPE rotates them."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


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
        # Meta's pairs (2k, 2k+1) -> rotate-half's (k, k + head_dim/2), within each head.
        tensor = tensor.reshape(heads, args.head_dim // 2, 2, -1).transpose(1, 2)
        tensor = tensor.reshape(heads * args.head_dim, -1)
    return f"model.layers.{index}.{_LAYER_NAMES[inner]}", tensor


def from_hf(
    name: str, tensor: torch.Tensor, args: ModelArgs, *, permute: bool = True
) -> tuple[str, torch.Tensor]:
    """The inverse of :func:`to_hf`: Hugging Face's name and tensor as plugtrain's."""
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
        tensor = tensor.reshape(heads, 2, args.head_dim // 2, -1).transpose(1, 2)
        tensor = tensor.reshape(heads * args.head_dim, -1)
    return ours, tensor
