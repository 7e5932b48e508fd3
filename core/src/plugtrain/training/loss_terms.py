"""The loss terms: added to each microbatch's loss before backward, and logged.

The plugins' (``loss_terms``) and the core's own: the model's, computed from what its forward
left (the moe family's load-balancing and router z-losses, ``model.moe.balance``, from the
router statistics ``LossContext.router``). Built only when some term is on: a run without one
computes its loss exactly as before and pays nothing for this.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from plugtrain.data import IGNORE_INDEX
from plugtrain.distributed import all_reduce_mean
from plugtrain.errors import PluginError
from plugtrain.host import PluginHost
from plugtrain.plugin import LossContext, StepContext, full_tensor

if TYPE_CHECKING:
    from plugtrain.model.moe.layer import RouterStats

OwnTerms = Callable[[LossContext], Mapping[str, torch.Tensor]]
"""The core's own terms of a microbatch, as a ``loss_terms`` implementation answers them."""


class LossTerms:
    """Adds the ``loss_terms`` hook's terms and the core's own (:attr:`own`, by name: ``moe``)
    to the loss and keeps their step means for logging."""

    def __init__(self, own: Mapping[str, OwnTerms] | None = None) -> None:
        self.own = dict(own or {})
        """The core's own terms by name (logged as ``<name>/<key>``), beside the plugins'."""
        self.sums: dict[str, torch.Tensor] = {}
        """Each term of the current step, ``<plugin>/<key>``, summed over its microbatches
        (each the microbatch's share, as the loss's): the step's term on this rank."""

    @classmethod
    def of(cls, host: PluginHost, own: Mapping[str, OwnTerms] | None = None) -> LossTerms | None:
        """The loss terms of a run whose plugins are set up, with the core's ``own``; None if
        neither a plugin nor the core adds any."""
        return cls(own) if own or host.implementers("loss_terms") else None

    def answers(self, host: PluginHost, ctx: LossContext) -> dict[str, Mapping[str, torch.Tensor]]:
        """Every term of microbatch ``ctx``, by plugin (or the core's own name)."""
        answers = dict(host.results("loss_terms", ctx=ctx))
        for name, terms in self.own.items():
            answers[name] = terms(ctx)
        return answers

    @staticmethod
    def context(
        ctx: StepContext,
        logits: torch.Tensor | None,
        targets: torch.Tensor,
        count: torch.Tensor | float,
        lse: torch.Tensor | None = None,
        router: Sequence[RouterStats] = (),
    ) -> LossContext:
        """What ``loss_terms`` receives for the current microbatch of step ``ctx``: its logits,
        or None and their log-sum-exp ``lse`` when the loss is computed in chunks; the mask of
        its counted targets and the step's ``count`` (see ``training.loss``); the ``router``
        statistics its forward left."""
        mask = targets != IGNORE_INDEX
        return LossContext(
            ctx.step, ctx.microbatch, ctx.num_microbatches, logits, targets, mask, count, lse,
            router,
        )  # fmt: skip

    def added_to(
        self,
        loss: torch.Tensor,
        answers: Mapping[str, Mapping[str, torch.Tensor]],
        ctx: StepContext,
    ) -> torch.Tensor:
        """``loss`` (a microbatch's share of the step's) plus the terms of ``answers``
        (:meth:`answers`) by plugin (each the microbatch's share of the step's term, normalised by
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
