"""The plugins' loss terms: added to each microbatch's loss before backward, and logged.

Built only when a plugin implements ``loss_terms``: a run without one computes its loss
exactly as before and pays nothing for this.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from plugtrain.data import IGNORE_INDEX
from plugtrain.distributed import all_reduce_mean
from plugtrain.errors import PluginError
from plugtrain.host import PluginHost
from plugtrain.plugin import LossContext, StepContext, full_tensor


class LossTerms:
    """Adds the ``loss_terms`` hook's terms to the loss and keeps their step means for logging."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        """Each term of the current step, ``<plugin>/<key>``, summed over its microbatches
        (each the microbatch's share, as the loss's): the step's term on this rank."""

    @classmethod
    def of(cls, host: PluginHost) -> LossTerms | None:
        """The loss terms of a run whose plugins are set up; None if no plugin adds any."""
        return cls() if host.implementers("loss_terms") else None

    @staticmethod
    def context(
        ctx: StepContext,
        logits: torch.Tensor | None,
        targets: torch.Tensor,
        count: torch.Tensor | float,
        lse: torch.Tensor | None = None,
    ) -> LossContext:
        """What ``loss_terms`` receives for the current microbatch of step ``ctx``: its logits,
        or None and their log-sum-exp ``lse`` when the loss is computed in chunks; the mask of
        its counted targets and the step's ``count`` (see ``training.loss``)."""
        mask = targets != IGNORE_INDEX
        return LossContext(
            ctx.step, ctx.microbatch, ctx.num_microbatches, logits, targets, mask, count, lse
        )

    def added_to(
        self,
        loss: torch.Tensor,
        answers: Mapping[str, Mapping[str, torch.Tensor]],
        ctx: StepContext,
    ) -> torch.Tensor:
        """``loss`` (a microbatch's share of the step's) plus the terms of ``loss_terms``'s
        ``answers`` by plugin (each the microbatch's share of the step's term, normalised by
        the step's count as the loss is), added in the order of their names."""
        if ctx.microbatch == 0:
            self.sums = {}
        terms = {}
        for plugin, named in answers.items():
            for key, value in named.items():
                if not isinstance(value, torch.Tensor) or value.ndim != 0:
                    raise PluginError(
                        f"plugin '{plugin}': loss_terms returned {key!r} = {type(value).__name__}"
                        f"{'' if not isinstance(value, torch.Tensor) else tuple(value.shape)}, "
                        "not a 0-d tensor: return the microbatch's share of the step's term"
                    )
                # A term of tensor-parallel logits is a replicated DTensor: its local value.
                terms[f"{plugin}/{key}"] = full_tensor(value)
        for name in sorted(terms):
            term = terms[name]
            loss = loss + term
            done = term.detach()
            self.sums[name] = self.sums[name] + done if name in self.sums else done
        return loss

    def metrics(self, world_size: int) -> dict[str, float]:
        """The current step's terms, averaged over ranks (a collective, on logging steps)."""
        if not self.sums:
            return {}
        names = sorted(self.sums)
        values = all_reduce_mean(torch.stack([self.sums[n].float() for n in names]), world_size)
        return dict(zip(names, values.tolist(), strict=True))
