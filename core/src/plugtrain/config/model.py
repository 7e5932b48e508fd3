"""The [model] section: the shape (a flavor, or a Hugging Face config.json) and the tokenizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from plugtrain.errors import ConfigError, FieldError, check_field, did_you_mean
from plugtrain.model import FAMILIES, FLAVORS, ModelArgs, RopeScaling, unknown_family
from plugtrain.model.moe.args import FLAVORS as MOE_FLAVORS


@dataclass
class ModelConfig:
    """The model's family and shape, and the tokenizer that sets its vocabulary."""

    family: str = field(default="llama", metadata={"choices": tuple(FAMILIES)})
    """The model family (``plugtrain.model.FAMILIES``): its architecture, flavors, tensor
    parallelism, Hugging Face format and memory formula (its ``ModelSpec``). ``llama``: Llama
    3's decoder (the keys below are its)."""
    flavor: str = field(default="debug", metadata={"choices": (*FLAVORS, *MOE_FLAVORS, "hf")})
    """Model size: ``tiny``, ``debug``, ``1B``, ``8B``... (``model.llama.args.FLAVORS``); with
    family ``moe``, ``debug_moe`` or ``qwen3_30b_a3b`` (``model.moe.args.FLAVORS``); or ``hf``:
    the shape a Hugging Face ``config.json`` gives (``model.hf_config``)."""
    hf_config: str = ""
    """With flavor ``hf``: a ``LlamaForCausalLM`` config.json (family ``moe``: a
    ``Qwen3MoeForCausalLM`` one), or the folder holding it. Its
    sizes, ``intermediate_size``, RoPE (theta, ``llama3`` scaling), tied embeddings, positions
    and vocabulary make the model; the tokenizer's vocabulary must fit in its ``vocab_size``.
    A field the model cannot express (biases, sliding window, another model or RoPE type) is
    refused, named."""
    tokenizer_path: str = ""
    """A ``tokenizers`` ``tokenizer.json``; its vocabulary size sets the model's (with flavor
    ``hf``, config.json's does). Unset (""): the ``tokenizer.json`` of the Hugging Face folder
    ``checkpoint.initial_load_path`` names, if it has one, else ``sample:tokenizer.json``. Here
    and in the data paths, ``sample:NAME`` names a file of the Shakespeare sample shipped with
    plugtrain; any other path is relative to the current folder."""
    tie_embeddings: bool = False
    """The output projection is the token embedding's matrix (Llama 3.2 1B/3B, SmolLM): one
    ``vocab x dim`` tensor fewer. Not with flavor ``hf`` (config.json says)."""
    ffn_dim: int | None = None
    """The SwiGLU hidden size exactly (Hugging Face's ``intermediate_size``); unset, the flavor
    derives it from its ``multiple_of`` and ``ffn_dim_multiplier``. Not with flavor ``hf``."""
    rope_scaling: Literal["none", "llama3"] = "none"
    """``llama3``: Llama 3.1's RoPE frequency scaling, set by the four ``rope_*`` keys below
    (their defaults are Llama 3.1's). Not with flavor ``hf``."""
    rope_scaling_factor: float = 8.0
    """llama3 scaling: the low frequencies are divided by this."""
    rope_low_freq_factor: float = 1.0
    """llama3 scaling: wavelengths above ``rope_original_max_seq_len / this`` are scaled."""
    rope_high_freq_factor: float = 4.0
    """llama3 scaling: wavelengths below ``rope_original_max_seq_len / this`` are kept."""
    rope_original_max_seq_len: int = 8192
    """llama3 scaling: the context length of the unscaled model."""
    attention: Literal["auto", "causal", "document"] = "auto"
    """``causal``: every token attends to all the tokens before it in its packed sequence,
    whichever document they belong to. ``document``: only to those of its own document (the
    documents' boundaries come from the token store); on CUDA through flex attention, on the
    CPU through SDPA with a boolean mask. With it, ``data.reset_positions`` defaults to true.
    ``auto``: ``document`` when the training data is chat (packed conversations never see
    each other), else ``causal``."""
    loss_chunks: int = 1
    """Compute the output projection and the cross-entropy in this many chunks of the
    microbatch's tokens, backward recomputing each chunk's logits (``model.loss.ChunkedLoss``):
    the loss's memory, ``12 * vocab`` bytes a token, falls by this factor, for one more pass of
    the output projection. 1: the whole logits at once."""
    moe_experts: int = 0
    """Family ``moe``: routed experts per block in place of the flavor's (0: the flavor's).
    Not with flavor ``hf``."""
    moe_top_k: int = 0
    """Family ``moe``: experts each token is routed to, at most ``moe_experts`` (0: the
    flavor's). Not with flavor ``hf``."""
    moe_aux_loss_weight: float = 0.0
    """Family ``moe``: weight of the load-balancing loss (Switch Transformer's, ``E * sum_e
    f_e * P_e`` averaged over the blocks, ``model.moe.balance``), added to the loss and logged
    as ``moe/aux_loss``; 0: none."""
    moe_z_loss_weight: float = 0.0
    """Family ``moe``: weight of the router z-loss (ST-MoE's mean squared log-sum-exp of the
    router logits, averaged over the blocks), logged as ``moe/router_z_loss``; 0: none."""
    moe_bias_update_rate: float = 0.0
    """Family ``moe``: DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step
    every block's expert selection bias moves by this much toward balance, ``bias += rate *
    sign(mean load - load)``, on the device; 0: the bias stays zero."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise unknown_family(self.family)
        # A family not named here has its flavors checked when it is loaded (model_args).
        if self.family in _FLAVORS:
            self._check_flavor(_FLAVORS[self.family])
        if self.flavor == "hf":
            for key, default in _SHAPE_OPTIONS.items():
                check_field(
                    getattr(self, key) == default,
                    key,
                    f"is {getattr(self, key)!r}, but with flavor 'hf' config.json sets the "
                    f"shape: leave it at {default!r}",
                )
        else:
            check_field(
                not self.hf_config,
                "hf_config",
                f"is set, but flavor is '{self.flavor}': set model.flavor = \"hf\" to use it",
            )
        check_field(self.loss_chunks >= 1, "loss_chunks", f"must be >= 1, got {self.loss_chunks}")
        self._check_moe()
        ffn_dim = self.ffn_dim
        check_field(ffn_dim is None or ffn_dim >= 1, "ffn_dim", f"must be >= 1, got {ffn_dim}")
        try:
            self.rope_scaling_args()
        except ValueError as e:
            raise FieldError("rope_scaling", f"is unusable: {e}") from None

    def _check_moe(self) -> None:
        """The ``moe_*`` keys: family ``moe``'s only, in range."""
        keys = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        moe = {k: v for k, v in keys.items() if k.startswith("moe_")}
        if self.family != "moe":
            for key, value in moe.items():
                check_field(
                    not value,
                    key,
                    f"is {value!r}, but model.family is '{self.family}', which has no experts: "
                    'set model.family = "moe" or leave it unset',
                )
        for key in ("moe_experts", "moe_top_k"):
            check_field(moe[key] >= 0, key, f"must be >= 0 (0: the flavor's), got {moe[key]}")
        for key in ("moe_aux_loss_weight", "moe_z_loss_weight", "moe_bias_update_rate"):
            check_field(moe[key] >= 0, key, f"must be >= 0 (0: off), got {moe[key]}")

    def _check_flavor(self, flavors: Iterable[str]) -> None:
        choices = (*flavors, "hf")
        other = [f for f, names in _FLAVORS.items() if f != self.family and self.flavor in names]
        if self.flavor not in choices and other:
            raise ConfigError(
                f"config key 'model.flavor' is '{self.flavor}', a flavor of family '{other[0]}', "
                f"but model.family is '{self.family}': set model.family = \"{other[0]}\""
            )
        if self.flavor not in choices:
            raise ConfigError(
                f"config key 'model.flavor' is '{self.flavor}'{did_you_mean(self.flavor, choices)};"
                f" choose one of {', '.join(choices)}"
            )

    def rope_scaling_args(self) -> RopeScaling | None:
        """The RoPE scaling the ``rope_*`` keys ask for, or None."""
        if self.rope_scaling == "none":
            return None
        return RopeScaling(
            factor=self.rope_scaling_factor,
            low_freq_factor=self.rope_low_freq_factor,
            high_freq_factor=self.rope_high_freq_factor,
            original_max_seq_len=self.rope_original_max_seq_len,
        )

    def model_args(self, vocab_size: int | None, seq_len: int) -> ModelArgs:
        """The shape a run of this config trains on sequences of ``seq_len`` tokens, with a
        tokenizer of ``vocab_size`` tokens (None: the flavor's or config.json's vocabulary).

        With flavor ``hf`` the embedding has config.json's rows; a tokenizer with more tokens is
        refused in one line. The RoPE table always reaches ``seq_len``.
        """
        # Here, not at the top: the rest of the config, and --help, need no torch.
        from plugtrain.model import check_family, model_spec, read_hf_config

        spec = model_spec(self.family)
        self._check_flavor(spec.flavors)
        if self.flavor == "hf":
            config = read_hf_config(self.hf_config)
            check_family(config, self.family, f"model.hf_config '{self.hf_config}'")
            args = spec.hf.args_from_hf(config)
            if vocab_size is not None and vocab_size > args.vocab_size:
                raise ConfigError(
                    f"the tokenizer has {vocab_size} tokens, more than the {args.vocab_size} "
                    f"rows of the embedding model.hf_config '{self.hf_config}' gives: use the "
                    "tokenizer of that model (model.tokenizer_path)"
                )
            return dataclasses.replace(
                args,
                max_seq_len=max(args.max_seq_len, seq_len),
                attention=ATTENTION_VARIANTS[self.attention],
            )
        args = spec.flavors[self.flavor]
        if self.family == "moe":
            args = self._moe_shape(args)
        return dataclasses.replace(
            args,
            vocab_size=args.vocab_size if vocab_size is None else vocab_size,
            max_seq_len=max(args.max_seq_len, seq_len),
            tie_embeddings=self.tie_embeddings,
            ffn_dim=self.ffn_dim if self.ffn_dim is not None else args.ffn_dim,
            rope_scaling=self.rope_scaling_args(),
            attention=ATTENTION_VARIANTS[self.attention],
        )

    def _moe_shape(self, args: Any) -> Any:
        """The moe flavor ``args`` with ``moe_experts`` and ``moe_top_k`` applied."""
        experts = self.moe_experts or args.num_experts
        top_k = self.moe_top_k or args.top_k
        if top_k > experts:
            key = "moe_top_k" if self.moe_top_k else "moe_experts"
            raise ConfigError(
                f"config key 'model.{key}' gives top-k {top_k} over {experts} experts: a token "
                "cannot be routed to more experts than there are; lower model.moe_top_k or "
                "raise model.moe_experts"
            )
        return dataclasses.replace(args, num_experts=experts, top_k=top_k)


_FLAVORS = {"llama": FLAVORS, "moe": MOE_FLAVORS}
"""The flavors of each family, read without torch (``--help``, the config's checks)."""


ATTENTION_VARIANTS = {"auto": "sdpa", "causal": "sdpa", "document": "document"}
"""``model.attention``'s values and the ``ModelArgs.attention`` variant each names (``auto``,
before the run has read its data and resolved it, as for ``plugtrain estimate``: causal)."""


_SHAPE_OPTIONS = {
    "tie_embeddings": False,
    "ffn_dim": None,
    "rope_scaling": "none",
    "moe_experts": 0,
    "moe_top_k": 0,
}
"""The [model] keys that change a flavor's shape, and their defaults (unset with flavor hf)."""
