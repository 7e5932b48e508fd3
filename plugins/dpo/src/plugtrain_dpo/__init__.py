"""DPO (direct preference optimisation) as a plugtrain plugin: the loss of preference pairs.

The run trains on preference data (``plugtrain.data.preference``): each sample holds whole
pairs, a chosen side as an even document and its rejected side as the next, each masked on its
completion. The plugin answers the step's loss (the ``build_loss`` hook): for each microbatch
it runs the policy (the model) and the reference (a frozen copy of the starting weights, or
with lora the policy with its adapters off) on the same rows, sums each side's
log-probabilities over its completion tokens and returns the pairs' DPO losses summed; the
trainer divides by the step's count of pairs over every microbatch and data-parallel rank, so
the step's loss is the mean over all its pairs whatever the split (not a mean of
per-microbatch means: ms-swift PR #10144).

With ``h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r))``:

* ``loss_type = "sigmoid"`` (the DPO paper, TRL's default):
  ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``, ``eps`` the
  ``label_smoothing`` (cDPO);
* ``loss_type = "ipo"``: ``(h - 1 / (2 beta))^2`` with each side's log-probability averaged
  over its completion tokens, as TRL computes IPO.

At step 1 the policy is the reference, ``h = 0`` and the sigmoid loss is ``ln 2``.

The reference (``reference = "copy"``) is built by ``SetupContext.frozen_copy``: laid out as
the model is (sharded by FSDP2), its forwards under ``torch.no_grad``, each resharded as it
ends (FSDP2 would leave the root and the last block gathered after a forward, holding a whole
embedding and output layer per GPU through the step: torchtune PR #2275). Under tensor
parallelism it is split as the model is, and both models' logits, split over the vocabulary,
give each token's log-probability through ``loss_parallel``'s cross-entropy, in which the
trainer runs the loss and its backward. It is saved with
each checkpoint (the plugin's state: as many bytes as the weights), since a resumed run skips
the initial load that gave the run its start.

With the ``lora`` plugin, ``reference = "adapters_off"`` makes the policy its own reference:
its forward runs with the adapters switched off (``plugtrain.plugin.additions_off``), which is
the frozen base model, so no second model is built or saved. As B starts at zero, it gives
what ``copy`` gives.

With ``reference = "precomputed"`` (``plugtrain_dpo.precomputed``) no reference runs during
training: before step 1 the starting weights' log-probs of every pair the run reads are
computed once and stored beside the prepared data, keyed by that start and that data; each
microbatch finds its pairs' again by its rows' sample numbers. The checkpoint records the key
only, and a resumed run reads the stored log-probs. It gives what ``copy`` gives.

Metrics, on logging steps and at validation, means over the step's (the pass's) pairs:
``dpo/rewards_chosen`` and ``dpo/rewards_rejected`` (``beta`` times each side's log-ratio to
the reference), ``dpo/margin`` (their difference) and ``dpo/reward_accuracy`` (the share of
pairs whose chosen reward is the larger).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plugtrain.plugin import (
    IGNORE_INDEX,
    MicroBatch,
    PluginError,
    SetupContext,
    StepContext,
    ValidationContext,
    additions_off,
    check_field,
    data_parallel_group,
    hookimpl,
    local_tensor,
)
from plugtrain_dpo.precomputed import ReferenceLogps, reference_logps

LOSS_TYPES = ("sigmoid", "ipo")
REFERENCES = ("copy", "adapters_off", "precomputed")
METRICS = ("rewards_chosen", "rewards_rejected", "reward_accuracy", "margin")


@dataclass
class DpoConfig:
    """The ``[dpo]`` config section."""

    # The objective, and the reference: a copy saves its weights with each checkpoint,
    # adapters_off none, so a resume that switched would compare with another reference.
    FIXED_ON_RESUME: ClassVar[tuple[str, ...]] = (
        "beta",
        "loss_type",
        "label_smoothing",
        "reference",
    )
    beta: float = 0.1
    """How far the policy may move from the reference: the scale of the log-ratios."""
    loss_type: str = "sigmoid"
    """``sigmoid`` (DPO) or ``ipo``."""
    label_smoothing: float = 0.0
    """The assumed share of pairs whose preference is flipped (cDPO), with ``sigmoid``."""
    reference: str = "copy"
    """``copy``: a frozen, sharded copy of the starting weights; ``adapters_off`` (with
    ``lora``): the policy itself with its adapters switched off, no second model;
    ``precomputed``: the starting weights' log-probs of every pair, computed once before step 1
    and stored beside the prepared data, no second model."""

    def __post_init__(self) -> None:
        check_field(0 < self.beta < math.inf, "beta", f"must be finite and > 0, got {self.beta}")
        check_field(
            self.loss_type in LOSS_TYPES,
            "loss_type",
            f"must be one of {LOSS_TYPES}, got {self.loss_type!r}",
        )
        check_field(
            0 <= self.label_smoothing < 0.5,
            "label_smoothing",
            f"must be in [0, 0.5), got {self.label_smoothing}",
        )
        check_field(
            self.label_smoothing == 0 or self.loss_type == "sigmoid",
            "label_smoothing",
            f"applies to loss_type 'sigmoid' only, not {self.loss_type!r}: set it to 0",
        )
        check_field(
            self.reference in REFERENCES,
            "reference",
            f"must be one of {REFERENCES}, got {self.reference!r}",
        )


def per_document(values: torch.Tensor, microbatch: MicroBatch) -> torch.Tensor:
    """``values`` (one per target, ``(rows, seq_len)``) summed by document, ``(rows,
    documents)`` with an even number of documents: even columns the chosen sides, odd ones the
    rejected."""
    documents = microbatch.documents
    assert documents is not None, "dpo checks model.attention = 'document' in setup"
    rows, seq_len = values.shape
    width = seq_len + seq_len % 2
    return values.new_zeros(rows, width).scatter_add_(1, documents.long(), values)


def completion_counts(microbatch: MicroBatch) -> torch.Tensor:
    """Each document's number of counted targets (its completion tokens), as
    :func:`per_document` lays them out, in fp32."""
    return per_document((microbatch.targets != IGNORE_INDEX).float(), microbatch)


def side_sums(logits: torch.Tensor, microbatch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each document's summed log-probability of its counted targets, and their number
    (:func:`completion_counts`), in fp32. A counted target is a completion token, never a
    document's first, so the input before it is of the same document. Under tensor
    parallelism ``logits`` are sharded over the vocabulary and this runs inside
    ``loss_parallel`` (the trainer's), whose cross-entropy reduces over the shards: each rank
    gets every token's log-probability, replicated, as one process computes it."""
    targets = microbatch.targets
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    logps = -local_tensor(losses).view(targets.shape)  # 0 where the target is IGNORE_INDEX
    return per_document(logps, microbatch), completion_counts(microbatch)


def pairs_of(counts: torch.Tensor) -> torch.Tensor:
    """Which (row, pair) slots hold a pair: both sides have completion tokens (a padding
    document, the last of its row, has none)."""
    return (counts[:, 0::2] > 0) & (counts[:, 1::2] > 0)


class Dpo:
    """Answers the loss of preference pairs against a frozen reference (see the module doc)."""

    def __init__(self) -> None:
        self.config = DpoConfig()
        self.reference: nn.Module | None = None
        """The frozen copy (``copy``); None with ``adapters_off``."""
        self.adapters_off: AbstractContextManager[None] | None = None
        """Where the policy computes as the base model (``adapters_off``)."""
        self.precomputed: ReferenceLogps | None = None
        """The reference's log-probs of every pair (``precomputed``)."""
        self.group: dist.ProcessGroup | None = None
        self.sums: torch.Tensor | None = None
        """The step's metric sums on this rank so far, then its pair count (see METRICS)."""

    @hookimpl
    def config_section(self) -> type:
        return DpoConfig

    @hookimpl
    def setup(self, ctx: SetupContext) -> None:
        self.config = ctx.plugin_config(self)
        if ctx.data_kind != "preference":
            raise PluginError(
                f"plugin 'dpo' trains on preference pairs, but the training data is "
                f"{ctx.data_kind}: set data.train_path to a JSONL file of "
                '{"prompt", "chosen", "rejected"} records (sample:preference_train.jsonl)'
            )
        if ctx.config.model.attention != "document" or ctx.config.data.chat_loss != "assistant":
            raise PluginError(
                "plugin 'dpo' needs model.attention = \"document\" (a pair's sides share a row "
                'and must not see each other) and data.chat_loss = "assistant" (the '
                "completions' tokens): leave both at their defaults"
            )
        if self.config.reference == "adapters_off":
            self.adapters_off = additions_off(ctx.model)
            if self.adapters_off is None:
                raise PluginError(
                    "dpo.reference = 'adapters_off' needs a plugin that adds adapters, e.g. "
                    "lora: enable it (plugins.enabled), or set dpo.reference = 'copy'"
                )
        elif self.config.reference == "precomputed":
            self.precomputed = reference_logps(ctx, side_sums)
        else:
            self.reference = ctx.frozen_copy()
        ctx.show_on_console(self, "reward_accuracy", "margin")
        dims = ctx.parallel_dims
        self.group = data_parallel_group(dims) if dims.dp_size > 1 else None

    @hookimpl
    def build_loss(self, ctx: SetupContext) -> Dpo:
        return self

    @hookimpl
    def state_dict(self) -> dict[str, Any] | None:
        # The reference's weights, saved with each checkpoint: a resume skips the initial load,
        # so the copy setup takes then is of the seeded init, not of the run's start. The
        # adapters_off reference is the frozen base, which the checkpoint (or its initial
        # load) already holds; the precomputed one is named by its key (32 bytes).
        if self.precomputed is not None:
            return {"precomputed": self.precomputed.key}
        if self.reference is None:
            return None
        return {"reference": dict(self.reference.named_parameters())}

    @hookimpl
    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.precomputed is not None:
            self.precomputed.load(state_dict["precomputed"])
            return
        assert self.reference is not None
        for name, param in self.reference.named_parameters():
            param.copy_(state_dict["reference"][name])

    def units(self, microbatch: MicroBatch) -> torch.Tensor:
        """The microbatch's pairs."""
        return pairs_of(completion_counts(microbatch)).sum()

    def __call__(self, model: nn.Module, microbatch: MicroBatch, index: int) -> torch.Tensor:
        """The microbatch's DPO losses, summed over its pairs."""
        with torch.no_grad():
            ref_sums, counts = self._reference_sums(model, microbatch)
        sums, _ = side_sums(model(microbatch.inputs, **microbatch.model_inputs()), microbatch)
        valid = pairs_of(counts)
        if self.config.loss_type == "ipo":  # IPO: log-probs averaged over the completion
            per_token = counts.clamp(min=1)
            sums, ref_sums = sums / per_token, ref_sums / per_token
        ratios = sums - ref_sums
        chosen, rejected = ratios[:, 0::2], ratios[:, 1::2]
        h = chosen - rejected
        beta = self.config.beta
        if self.config.loss_type == "ipo":
            losses = (h - 1 / (2 * beta)).square()
        else:
            eps = self.config.label_smoothing
            losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
        self._observe(beta * chosen.detach(), beta * rejected.detach(), valid, index)
        return torch.where(valid, losses, 0.0).sum()

    def _reference_sums(
        self, model: nn.Module, microbatch: MicroBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's :func:`side_sums` of ``microbatch``: looked up (``precomputed``), or
        from a forward of the policy with its adapters off, or of the frozen copy."""
        if self.precomputed is not None:
            counts = completion_counts(microbatch)
            return self.precomputed.lookup(microbatch, counts), counts
        inputs, extra = microbatch.inputs, microbatch.model_inputs()
        if self.adapters_off is not None:
            with self.adapters_off:
                return side_sums(model(inputs, **extra), microbatch)
        assert self.reference is not None
        # Resharded as its forward ends (SetupContext.frozen_copy).
        return side_sums(self.reference(inputs, **extra), microbatch)

    def _observe(
        self, chosen: torch.Tensor, rejected: torch.Tensor, valid: torch.Tensor, microbatch: int
    ) -> None:
        """Add the microbatch's pairs to the step's metric sums (on the device)."""
        values = [chosen, rejected, (chosen > rejected).float(), chosen - rejected]
        sums = torch.stack(
            [torch.where(valid, v, 0.0).sum() for v in values] + [valid.sum().float()]
        )
        self.sums = sums if microbatch == 0 or self.sums is None else self.sums + sums

    @hookimpl
    def step_metrics(self, ctx: StepContext) -> dict[str, torch.Tensor] | None:
        return self._means()

    @hookimpl
    def validation_metrics(self, ctx: ValidationContext) -> dict[str, torch.Tensor] | None:
        return self._means()  # the pass's pairs: validation calls the loss on each batch

    def _means(self) -> dict[str, torch.Tensor] | None:
        """The metrics of the step or validation pass just computed, means over its pairs on
        every data-parallel rank."""
        if self.sums is None:
            return None
        sums = self.sums.clone()
        if self.group is not None:
            dist.all_reduce(sums, group=self.group)
        means = sums[:-1] / sums[-1].clamp(min=1)
        return dict(zip(METRICS, means.unbind(), strict=True))
