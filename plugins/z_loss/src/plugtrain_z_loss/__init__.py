"""PaLM's z-loss, ``weight * logsumexp(logits)^2`` averaged over targets, as a plugtrain plugin.

The auxiliary loss keeps the softmax normaliser ``log Z = logsumexp(logits)`` near zero, which
keeps the logits from drifting and large-scale bf16 training stable (PaLM, OLMo, MaxText use
``weight = 1e-4``). It is a loss term (the ``loss_terms`` hook): the trainer adds it to each
microbatch's loss before ``pre_backward``, so a loss scaler scales it with the rest, and logs
it as ``<plugin name>/z_loss``, over the step and averaged over ranks like the loss. It is
masked and normalised as the cross-entropy is (as OLMo-core divides its z-loss by the
cross-entropy's factor): the sum over the targets that count, ``ctx.mask`` (with chat data the
assistant's), divided by the step's count of them, ``ctx.count``. With text, where every
target counts, that is the mean over the step's tokens. The console
line leaves it out: a small term that moves slowly, it is read in ``metrics.jsonl`` and the
sinks, while the console's ``loss`` stays the cross-entropy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plugtrain.plugin import LossContext, SetupContext, check_field, hookimpl

__all__ = ["ZLoss", "ZLossConfig"]


@dataclass
class ZLossConfig:
    """The ``[z_loss]`` config section."""

    weight: float = 1e-4
    """The z-loss's factor: the term is ``weight * mean over counted targets of
    logsumexp(logits)^2``."""

    def __post_init__(self) -> None:
        check_field(
            0 < self.weight < math.inf,
            "weight",
            f"must be finite and > 0, got {self.weight} (to train without z-loss, remove "
            "the plugin from plugins.enabled)",
        )


class ZLoss:
    """Adds ``weight * logsumexp(logits)^2`` summed over the counted targets over the step's
    count of them to the loss, for every microbatch."""

    def __init__(self) -> None:
        self.config = ZLossConfig()

    @hookimpl
    def config_section(self) -> type:
        return ZLossConfig

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.config = ctx.plugin_config(self)

    @hookimpl
    def loss_terms(self, ctx: LossContext) -> dict[str, torch.Tensor]:
        masked = ctx.lse.square() * ctx.mask
        return {"z_loss": self.config.weight * masked.sum() / ctx.count}
