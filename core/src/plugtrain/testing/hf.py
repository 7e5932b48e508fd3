"""Hugging Face folders for tests: random Llama and Qwen3-MoE models built offline.

:func:`hf_qwen3_moe_folder` saves a tiny Qwen3-MoE (the moe family's format) as
:func:`hf_llama_folder` saves a Llama, and :func:`hf_logits` is transformers' answer for either.
:func:`hf_llama_folder` saves a tiny model of one of :data:`HF_VARIANTS` with transformers'
own ``save_pretrained`` (sharded on request), next to the sample's tokenizer, as a real
checkpoint of that family would be laid out; :func:`save_random_llama` saves one of a plugtrain
shape instead; :func:`hf_llama_logits` is transformers' answer for such a folder, the reference
an import is checked against. transformers is imported here
only, when first asked for (it comes with the ``dev`` requirements, not with plugtrain).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Literal

import torch

from plugtrain import sample
from plugtrain.model import ModelArgs, hf_config

__all__ = [
    "CHAT_TEMPLATES",
    "HF_VARIANTS",
    "hf_chat_tokenizer",
    "hf_llama_config",
    "hf_llama_folder",
    "hf_llama_logits",
    "hf_logits",
    "hf_qwen3_moe_config",
    "hf_qwen3_moe_folder",
    "hf_tensors",
    "save_random_llama",
]

Variant = Literal["plain", "tied", "scaled"]
HF_VARIANTS: tuple[Variant, ...] = ("plain", "tied", "scaled")
"""``plain``: untied with grouped-query attention (Llama 3 8B's layout); ``tied``: tied
embeddings (Llama 3.2 1B/3B, SmolLM); ``scaled``: Llama 3.1's ``llama3`` RoPE scaling over an
original context of 64 positions, so that sequences of 128 tokens see every regime (kept,
interpolated and divided frequencies)."""


CHAT_TEMPLATES: dict[str, str] = {
    "llama3": (
        "{{- bos_token }}\n"
        "{%- for message in messages %}\n"
        "    {%- if message['role'] not in ['system', 'user', 'assistant'] %}\n"
        "        {{- raise_exception('unknown role ' + message['role']) }}\n"
        "    {%- endif %}\n"
        "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
        "    {{- message['content'] | trim + '<|eot_id|>' }}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}\n"
        "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
        "{%- endif %}\n"
    ),
    "chatml": (
        "{% for message in messages %}\n"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}\n"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
}
"""Chat templates of two families, written for the tests: Llama 3's layout (a BOS, role headers,
``<|eot_id|>`` after each turn, contents trimmed) and ChatML's (``<|im_start|>role``, a newline
after each ``<|im_end|>``: the template's line breaks that ``trim_blocks`` keeps)."""
CHAT_TOKENS = (
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
)
"""The special tokens :func:`hf_chat_tokenizer` adds to the sample's 2048: ids 2048 to 2052."""


def hf_chat_tokenizer(
    path: str | os.PathLike[str], style: str = "llama3", *, in_config: bool = False
) -> Path:
    """Save the sample tokenizer plus :data:`CHAT_TOKENS`, with the chat template
    ``CHAT_TEMPLATES[style]``, to folder ``path`` with transformers' ``save_pretrained``
    (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``); ``in_config``
    moves the template into tokenizer_config.json's ``chat_template``, the older layout.
    Returns ``path``."""
    import tokenizers
    import transformers

    raw = tokenizers.Tokenizer.from_file(str(sample.resolve("sample:tokenizer.json")))
    raw.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in CHAT_TOKENS])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )
    fast.chat_template = CHAT_TEMPLATES[style]
    path = Path(path)
    fast.save_pretrained(path)
    if in_config:
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["chat_template"] = (path / "chat_template.jinja").read_text()
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (path / "chat_template.jinja").unlink()
    return path


def hf_llama_config(variant: Variant = "plain", **overrides: Any) -> dict[str, Any]:
    """The ``LlamaConfig`` keyword arguments of a tiny model of ``variant`` (2 layers, width 64,
    4 query and 2 key/value heads, an ``intermediate_size`` no ``multiple_of`` rule gives, the
    sample tokenizer's 2048 tokens, 256 positions), with ``overrides`` on top."""
    if variant not in HF_VARIANTS:
        raise ValueError(f"variant {variant!r} is not one of {HF_VARIANTS}")
    config: dict[str, Any] = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 96,
        "vocab_size": 2048,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": variant == "tied",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    if variant == "scaled":
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    return config | overrides


def hf_llama_folder(
    path: str | os.PathLike[str],
    variant: Variant = "plain",
    *,
    max_shard_size: int | str | None = None,
    seed: int = 0,
    tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """Save a random float32 ``LlamaForCausalLM`` of :func:`hf_llama_config` ``(variant,
    **overrides)`` to folder ``path`` with ``save_pretrained`` (in shards of at most
    ``max_shard_size``, with ``model.safetensors.index.json``, when given), its weights drawn
    from ``seed`` (the global generator is left as it was); with ``tokenizer``, the sample's
    ``tokenizer.json`` too. Returns ``path``."""
    tokenizer_file = sample.resolve("sample:tokenizer.json") if tokenizer else None
    return _save(
        path, hf_llama_config(variant, **overrides), torch.float32, seed, max_shard_size,
        tokenizer_file,
    )  # fmt: skip


def hf_qwen3_moe_config(**overrides: Any) -> dict[str, Any]:
    """The ``Qwen3MoeConfig`` keyword arguments of a tiny model (3 blocks, the first dense;
    width 64, 4 query heads of 32 channels, so that ``n_heads * head_dim`` is not the width, and
    2 key/value heads; 8 experts of hidden size 32, top-2, renormalised; the sample tokenizer's
    2048 tokens), weights drawn with std 0.2 (logits far from uniform, routing far from even),
    with ``overrides`` on top."""
    config: dict[str, Any] = {
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [0],
        "vocab_size": 2048,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "initializer_range": 0.2,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    return config | overrides


def hf_qwen3_moe_folder(
    path: str | os.PathLike[str], *, seed: int = 0, tokenizer: bool = True, **overrides: Any
) -> Path:
    """Save a random float32 ``Qwen3MoeForCausalLM`` of :func:`hf_qwen3_moe_config`
    ``(**overrides)`` to folder ``path``, as :func:`hf_llama_folder` saves a Llama."""
    tokenizer_file = sample.resolve("sample:tokenizer.json") if tokenizer else None
    return _save(
        path, hf_qwen3_moe_config(**overrides), torch.float32, seed, None, tokenizer_file,
        architecture="Qwen3Moe",
    )  # fmt: skip


def save_random_llama(
    folder: str | os.PathLike[str],
    args: ModelArgs,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str | None = None,
    tokenizer: str | os.PathLike[str] | None = None,
) -> Path:
    """Save a random ``LlamaForCausalLM`` of plugtrain shape ``args`` (its config from
    :func:`~plugtrain.model.hf_config`) to ``folder``, in ``dtype``, sharded as
    :func:`hf_llama_folder` does; ``tokenizer``, a ``tokenizer.json``, is copied in.

    The weights are drawn with std 0.2 rather than transformers' 0.02, so that the logits are
    far from uniform: the loss of the loaded model (about ln(vocab) + 0.6 for the tiny shape)
    then tells it from a freshly initialised one (about ln(vocab))."""
    config = hf_config(args, dtype=dtype, bos_token_id=None, eos_token_id=None)
    config["initializer_range"] = 0.2
    return _save(folder, config, dtype, seed, max_shard_size, tokenizer)


def _save(
    path: str | os.PathLike[str],
    config: dict[str, Any],
    dtype: torch.dtype,
    seed: int,
    max_shard_size: int | str | None,
    tokenizer: str | os.PathLike[str] | None,
    architecture: str = "Llama",
) -> Path:
    import transformers

    path = Path(path)
    model_class = getattr(transformers, f"{architecture}ForCausalLM")
    config_class = getattr(transformers, f"{architecture}Config")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config_class(**config)).to(dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, path / "tokenizer.json")
        tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config) + "\n")
    return path


def hf_llama_logits(path: str | os.PathLike[str], tokens: torch.Tensor) -> torch.Tensor:
    """transformers' float32 logits ``[B, S, vocab]`` for ``tokens`` ``[B, S]``, from the
    model it loads from folder ``path``."""
    return hf_logits(path, tokens)


def hf_tensors(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of Hugging Face folder ``folder`` (whole or sharded), by its name there,
    in the files' order."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    tensors = {}
    for file in files:
        with safe_open(folder / file, "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    return tensors


def hf_logits(path: str | os.PathLike[str], tokens: torch.Tensor) -> torch.Tensor:
    """:func:`hf_llama_logits` for a folder of any architecture transformers reads (its
    ``AutoModelForCausalLM``)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits
