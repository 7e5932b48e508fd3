"""What the model writes after fixed prompts, at each validation, as a plugtrain plugin.

At each validation, on the model's own weights (``validation_metrics`` with ``ctx.weights``
None), every rank continues each prompt with :func:`plugtrain.plugin.complete`, the decoding
loop ``plugtrain generate`` uses, on the model as it trains (FSDP2-sharded, tensor-parallel or
neither: every rank joins each forward, and all write the same tokens, greedy or from the same
seed; under tensor parallelism each reads the logits whole). The texts go into the validation
record as ``samples/<i>`` (``metrics.jsonl``; TensorBoard text when enabled) and to the log on
rank 0. The trainer reshards the model after the hook, so the
generation leaves nothing behind.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from plugtrain.plugin import (
    SetupContext,
    TextTokenizer,
    ValidationContext,
    check_field,
    complete,
    hookimpl,
    refuse_split_model,
)

__all__ = ["Samples", "SamplesConfig"]

logger = logging.getLogger("plugtrain")


@dataclass
class SamplesConfig:
    """The ``[samples]`` config section."""

    prompts: list[str] = field(default_factory=lambda: ["ROMEO:"])
    """The texts to continue, each logged as ``samples/<its index>``."""
    max_new_tokens: int = 32
    """Tokens written after each prompt at most (fewer when the model ends the text)."""
    temperature: float = 0.0
    """0: greedy. Above 0, sampled from a generator seeded with ``seed`` at each validation."""
    seed: int = 0

    def __post_init__(self) -> None:
        check_field(bool(self.prompts), "prompts", "must hold at least one prompt")
        check_field(
            self.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {self.max_new_tokens}"
        )
        check_field(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")


class Samples:
    """Writes ``samples/<i>``, the continuation of ``prompts[i]``, at each validation."""

    def __init__(self) -> None:
        self.config = SamplesConfig()
        self.name = "samples"
        self.rank = 0
        self.tokenizer: TextTokenizer | None = None
        self.model = None

    @hookimpl
    def config_section(self) -> type:
        return SamplesConfig

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.config = ctx.plugin_config(self)
        self.name, self.rank = ctx.name_of(self), ctx.parallel_dims.rank
        refuse_split_model(ctx.parallel_dims, self.name)
        self.model, self.tokenizer = ctx.model, ctx.tokenizer
        if not ctx.config.validation.interval:
            reason = "validation.interval is 0: no validation to write samples at"
            if self.rank == 0:
                logger.warning("%s: %s", self.name, reason)
            ctx.deactivate(self, reason)

    @hookimpl
    def validation_metrics(self, ctx: ValidationContext) -> dict[str, str] | None:
        if ctx.weights is not None:
            return None
        assert self.tokenizer is not None, "setup gives the run's tokenizer"
        cfg = self.config
        texts = {}
        for i, prompt in enumerate(cfg.prompts):
            text = complete(
                self.model,
                self.tokenizer,
                prompt,
                cfg.max_new_tokens,
                temperature=cfg.temperature,
                seed=cfg.seed + i,
            )
            texts[str(i)] = text
            if self.rank == 0:
                logger.info("%s/%d at step %d: %r -> %r", self.name, i, ctx.step, prompt, text)
        return texts
