"""The moe family's Hugging Face format: ``Qwen3MoeForCausalLM``'s config.json and tensor names.

Llama's names (``model.llama.hf``) for what the two share, plus Qwen3's head norms
(``self_attn.q_norm``, ``k_norm``), the router (``mlp.gate``) and the experts, which Hugging
Face stores one tensor per expert (``mlp.experts.E.gate_proj.weight``) and plugtrain stacks
(``moe.experts.w1``): each expert is a piece of the stacked parameter (``HFAdapter.stacked``).
RoPE's layout differs as for Llama: the rows of ``wq`` and ``wk`` are permuted within each head,
and so are the channels of ``q_norm`` and ``k_norm``, which normalise the same channels before
RoPE. Qwen3-MoE has no shared expert: a model with one is refused by the writer.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from plugtrain.errors import CheckpointError, one_line
from plugtrain.model.llama.hf import (
    decoder_config,
    hf_rope_rows,
    meta_rope_rows,
    refuse_field,
    rope_from_hf,
)
from plugtrain.model.moe.args import MoEArgs

__all__ = [
    "from_hf",
    "hf_config",
    "model_args_from_hf",
    "parameter_shapes",
    "stacked",
    "to_hf",
]

_ATTENTION = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_DENSE = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_ROUTER = {"moe.router.gate.weight": "mlp.gate.weight"}
_EXPERTS = {
    "moe.experts.w1": "gate_proj",
    "moe.experts.w2": "down_proj",
    "moe.experts.w3": "up_proj",
}
"""A stacked parameter -> each expert's Hugging Face projection, ``mlp.experts.E.<it>.weight``."""
_LAYER = _ATTENTION | _DENSE | _ROUTER
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_FROM_LAYER = {hf: ours for ours, hf in _LAYER.items()}
_FROM_TOP = {hf: ours for ours, hf in _TOP.items()}
_FROM_EXPERT = {hf: ours for ours, hf in _EXPERTS.items()}
_OURS = re.compile(r"layers\.(\d+)\.(.+)")
_OURS_PIECE = re.compile(r"layers\.(\d+)\.(moe\.experts\.w[123])\[(\d+)\]")
_HF = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight")


def stacked(name: str, args: MoEArgs) -> bool:
    """Whether ``name`` is a layer's stacked experts (stored one tensor per expert)."""
    match = _OURS.fullmatch(name)
    return match is not None and match[2] in _EXPERTS


def hf_config(
    args: MoEArgs, *, dtype: torch.dtype, bos_token_id: int | None, eos_token_id: int | None
) -> dict[str, Any]:
    """config.json of ``Qwen3MoeForCausalLM`` for a model of shape ``args`` stored in ``dtype``
    (a model with a shared expert is refused: the format has none)."""
    if args.shared_ffn_dim:
        raise CheckpointError(
            f"the model has a shared expert (shared_ffn_dim {args.shared_ffn_dim}), which "
            "Qwen3MoeForCausalLM has no place for: export a model without one"
        )
    tokens = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **decoder_config(args, dtype=dtype, **tokens),
        "moe_intermediate_size": args.moe_ffn_dim,
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": args.norm_topk_prob,
        "decoder_sparse_step": args.decoder_sparse_step,
        "mlp_only_layers": list(args.mlp_only_layers),
        "use_sliding_window": False,
        "sliding_window": None,
        "output_router_logits": False,
    }


_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "vocab_size",
)
"""The fields of config.json without a default."""


def model_args_from_hf(config: dict[str, Any]) -> MoEArgs:
    """The :class:`MoEArgs` of a ``Qwen3MoeForCausalLM`` config.json; a one-line
    :class:`CheckpointError` naming the field it cannot express."""
    for field, wanted, why in (
        ("model_type", "qwen3_moe", "only Qwen3-MoE models are supported by family 'moe'"),
        ("hidden_act", "silu", "the experts are SwiGLU"),
        ("attention_bias", False, "attention projections have no bias"),
        ("attention_dropout", 0.0, "the model has no dropout"),
        ("use_sliding_window", False, "attention is global"),
    ):
        value = config.get(field, wanted if field != "model_type" else None)
        if value != wanted:
            raise refuse_field(field, value, why)
    if config.get("architectures", ["Qwen3MoeForCausalLM"]) != ["Qwen3MoeForCausalLM"]:
        raise refuse_field("architectures", config["architectures"], "only Qwen3MoeForCausalLM is")
    missing = [field for field in _REQUIRED if field not in config]
    experts = config.get("num_experts", config.get("num_local_experts"))
    if experts is None:
        missing.append("num_experts")
    if missing:
        raise CheckpointError(
            f"config.json has no field '{missing[0]}': give the config of a Qwen3MoeForCausalLM"
        )
    theta, scaling = rope_from_hf(config)
    try:
        return MoEArgs(
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=config["num_attention_heads"],
            n_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            head_dim=config.get("head_dim") or 0,
            vocab_size=config["vocab_size"],
            num_experts=experts,
            top_k=config["num_experts_per_tok"],
            moe_ffn_dim=config["moe_intermediate_size"],
            ffn_dim=config.get("intermediate_size") or None,  # 0: no dense block (our export)
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            decoder_sparse_step=config.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_seq_len=config.get("max_position_embeddings", 2048),
            tie_embeddings=config.get("tie_word_embeddings", False),
            rope_scaling=scaling,
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"config.json describes an unusable model: {one_line(e)}") from e


def parameter_shapes(args: MoEArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``MoETransformer(args)`` by plugtrain's name, in the model's order."""
    d, hd = args.dim, args.head_dim
    q, kv = args.n_heads * hd, args.n_kv_heads * hd
    attention = dict(
        zip(
            _ATTENTION,
            [(d,), (q, d), (kv, d), (kv, d), (d, q), (hd,), (hd,), (d,)],
            strict=True,
        )
    )
    e, h = args.num_experts, args.moe_ffn_dim
    moe = {
        "moe.router.gate.weight": (e, d),
        "moe.experts.w1": (e, h, d),
        "moe.experts.w2": (e, d, h),
        "moe.experts.w3": (e, h, d),
    }
    if args.shared_ffn_dim:
        s = args.shared_ffn_dim
        moe |= {
            "moe.shared_experts.w1.weight": (s, d),
            "moe.shared_experts.w2.weight": (d, s),
            "moe.shared_experts.w3.weight": (s, d),
        }
    f = args.ffn_hidden_dim
    dense = {"feed_forward.w1.weight": (f, d), "feed_forward.w2.weight": (d, f),
             "feed_forward.w3.weight": (f, d)}  # fmt: skip
    shapes = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        layer = attention | (moe if args.is_moe_layer(i) else dense)
        shapes.update({f"layers.{i}.{name}": shape for name, shape in layer.items()})
    shapes["norm.weight"] = (d,)
    if not args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, d)
    return shapes


def _rope_heads(inner: str, args: MoEArgs) -> int | None:
    """Number of heads whose rows (channels) ``inner`` holds, if RoPE rotates them."""
    return {
        "attention.wq.weight": args.n_heads,
        "attention.wk.weight": args.n_kv_heads,
        "attention.q_norm.weight": 1,
        "attention.k_norm.weight": 1,
    }.get(inner)


def _unknown(name: str, side: str) -> CheckpointError:
    return CheckpointError(
        f"tensor '{name}' has no place in the Hugging Face Qwen3-MoE format ({side} names only "
        "the parameters of plugtrain's MoETransformer without a shared expert): export a model "
        "without it"
    )


def to_hf(
    name: str, tensor: torch.Tensor, args: MoEArgs, *, permute: bool = True
) -> tuple[str, torch.Tensor]:
    """plugtrain parameter (or expert piece, ``layers.1.moe.experts.w1[3]``) ``name`` and its
    full tensor as Hugging Face's name and tensor; ``permute=False`` leaves q/k in plugtrain's
    RoPE layout."""
    if name in _TOP:
        return _TOP[name], tensor
    piece = _OURS_PIECE.fullmatch(name)
    if piece is not None:
        index, inner, expert = piece.groups()
        return f"model.layers.{index}.mlp.experts.{expert}.{_EXPERTS[inner]}.weight", tensor
    match = _OURS.fullmatch(name)
    if match is None or match[2] not in _LAYER:
        raise _unknown(name, "plugtrain")
    index, inner = match.groups()
    heads = _rope_heads(inner, args)
    if heads is not None and permute:
        tensor = hf_rope_rows(tensor, heads, args.head_dim)
    return f"model.layers.{index}.{_LAYER[inner]}", tensor


def from_hf(
    name: str, tensor: torch.Tensor, args: MoEArgs, *, permute: bool = True
) -> tuple[str, torch.Tensor]:
    """The inverse of :func:`to_hf`: Hugging Face's name and tensor as plugtrain's (an
    expert's as its piece of the stacked parameter)."""
    if name == "lm_head.weight" and args.tie_embeddings:
        raise CheckpointError(
            "tensor 'lm_head.weight' is in the folder, but its config.json sets "
            "tie_word_embeddings: the model has no separate output projection; set it to false"
        )
    if name in _FROM_TOP:
        return _FROM_TOP[name], tensor
    match = _HF.fullmatch(name)
    if match is None:
        raise _unknown(name, "Hugging Face")
    index, inner = match.groups()
    expert = _HF_EXPERT.fullmatch(inner)
    if expert is not None:
        return f"layers.{index}.{_FROM_EXPERT[expert[2]]}[{expert[1]}]", tensor
    if inner not in _FROM_LAYER:
        raise _unknown(name, "Hugging Face")
    ours = _FROM_LAYER[inner]
    heads = _rope_heads(ours, args)
    if heads is not None and permute:
        tensor = meta_rope_rows(tensor, heads, args.head_dim)
    return f"layers.{index}.{ours}", tensor
