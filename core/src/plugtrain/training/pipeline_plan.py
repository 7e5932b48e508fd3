"""A pipeline's plan before any run.

Which stages each rank holds, the microbatches a schedule needs, what each rank keeps in
flight, and the schedule's bubble: for ``plugtrain estimate`` and the runtime alike (one
refusal, one set of numbers). ``pp`` is the pipeline ranks, ``v`` the stages each holds
(``parallelism.stages_per_rank``), ``m`` the microbatches of a step
(``training.grad_accum_steps``); a *chunk* is one stage's share of the blocks for one
microbatch, ``n_layers / (pp * v)`` blocks.

**Microbatches** a schedule needs, as torch 2.13's ``torch.distributed.pipelining.schedules``
checks them (:func:`check_microbatches`): GPipe any; 1F1B ``m >= pp``; Interleaved1F1B ``m`` a
multiple of its rounds, ``max(1, m // pp)``; DualPipeV ``m >= 2 pp`` (its stages).
ZBVZeroBubble is accepted by torch with any ``m`` but builds its schedule for ``2 pp - 1``
microbatches and leaves the missing ones' slots empty: plugtrain asks for at least ``2 pp - 1``,
below which the V is never full and the schedule is not zero-bubble.

**Bubble** (:func:`bubble_fraction`), the idle share of a step's time on each rank when a
chunk's forward and backward take the same time everywhere and communication is free:

* GPipe and 1F1B: ``(pp - 1) / (m + pp - 1)`` (Huang et al. 2019, GPipe; Narayanan et al.
  2021, Megatron-LM §2.2: a bubble of ``pp - 1`` microbatches' time besides ``m``);
* Interleaved1F1B: ``(pp - 1) / (v m + pp - 1)`` (Narayanan et al. 2021 §2.2: the bubble
  shrinks ``v`` times; exact where ``m`` is a multiple of ``pp``, roughly otherwise);
* ZBVZeroBubble: 0 (Qi et al. 2024, Zero Bubble Pipeline Parallelism §6, ZB-V: the weight
  gradients fill the bubble when a forward, an input-gradient and a weight-gradient pass take
  the same time, and ``m >= 2 pp - 1``);
* DualPipeV: 0 under the same assumption (DeepSeek-V3 report, Table 2: DualPipe's bubble
  ``(pp/2 - 1)(F&B + B - 3W)`` is 0 when ``F = B = W`` and ``F&B = F + B``; DualPipeV is its
  V half on ``pp`` ranks).

**In flight** (:func:`pipeline_share`): the chunks whose activations a rank keeps at its
peak. GPipe: all ``m``; 1F1B: ``min(m, pp - r)`` on rank ``r`` (Narayanan et al. 2021);
Interleaved1F1B: torch's (and Megatron's) warm-up, ``(v - 1) mpr + 2 (pp - 1 - r)``, plus
the one forward of the steady state, at most ``v m`` (``mpr`` = ``m`` / rounds; Korthikanti et
al. 2022 §4.2.3 give the same ``pp (1 + (pp - 1) / (pp v))`` stages' worth on rank 0);
ZBVZeroBubble: ``2 pp`` chunks on every rank, 1F1B's ``pp`` stages' worth (Qi et al. 2024 §6,
read off torch's ZBV warm-up); DualPipeV: ``2 pp + 2``, DualPipe's ``pp + 1`` stages' worth
(DeepSeek-V3 Table 2). The last stage keeps one microbatch's logits at a time, GPipe all ``m``.
"""

from __future__ import annotations

from fractions import Fraction

from plugtrain.config import PIPELINE_SCHEDULES, V_SCHEDULES
from plugtrain.errors import ConfigError
from plugtrain.model import PipelineShare
from plugtrain.model.llama.pipeline import stage_layers

__all__ = [
    "bubble_fraction",
    "check_microbatches",
    "check_pipeline",
    "pipeline_share",
    "rank_stages",
]


def rank_stages(schedule: str, pp: int, stages_per_rank: int, rank: int) -> tuple[int, ...]:
    """The stages pipeline rank ``rank`` holds, in order: ``rank`` and ``2 pp - 1 - rank`` in
    a V schedule (the first and last stage on rank 0), else every ``pp``-th from ``rank``
    (torch's loop placement)."""
    if schedule in V_SCHEDULES:
        return (rank, 2 * pp - 1 - rank)
    return tuple(rank + k * pp for k in range(stages_per_rank))


def check_microbatches(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> None:
    """Refuse, in one ``ConfigError`` line, ``microbatches`` a step that ``schedule`` on ``pp``
    ranks of ``stages_per_rank`` stages cannot run (the module docstring lists the rules)."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"{schedule} is not one of {PIPELINE_SCHEDULES}")
    m, stages = microbatches, pp * stages_per_rank
    least = {"1F1B": pp, "ZBVZeroBubble": 2 * pp - 1, "DualPipeV": stages}.get(schedule, 1)
    if m < least:
        raise ConfigError(
            f"training.grad_accum_steps = {m} microbatches are fewer than {schedule} needs on "
            f"{pp} pipeline ranks ({stages} stages): set grad_accum_steps to {least} or more"
        )
    rounds = max(1, m // pp)
    if schedule == "Interleaved1F1B" and m % rounds:
        raise ConfigError(
            f"training.grad_accum_steps = {m} is not a multiple of Interleaved1F1B's rounds "
            f"max(1, {m} // pp {pp}) = {rounds}: set grad_accum_steps to a multiple of {pp}"
        )


def check_pipeline(
    n_layers: int, schedule: str, pp: int, stages_per_rank: int, microbatches: int
) -> None:
    """Refuse, in one ``ConfigError`` line, ``n_layers`` that do not divide into ``pp *
    stages_per_rank`` stages, and too few ``microbatches`` (:func:`check_microbatches`)."""
    stage_layers(n_layers, pp * stages_per_rank, 0)
    check_microbatches(schedule, pp, stages_per_rank, microbatches)


def bubble_fraction(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> Fraction:
    """The idle share of a step's time on each rank, in theory (the module docstring)."""
    if pp == 1 or schedule in V_SCHEDULES:
        return Fraction(0)
    v = stages_per_rank if schedule == "Interleaved1F1B" else 1
    return Fraction(pp - 1, v * microbatches + pp - 1)


def pipeline_share(
    schedule: str, pp: int, stages_per_rank: int, microbatches: int, rank: int
) -> PipelineShare:
    """What pipeline rank ``rank`` holds and keeps in flight (the module docstring)."""
    m, v = microbatches, stages_per_rank
    if schedule == "GPipe":
        chunks = m * v
    elif schedule == "1F1B":
        chunks = min(m, pp - rank)
    elif schedule == "Interleaved1F1B":
        per_round = m // max(1, m // pp)
        chunks = min((v - 1) * per_round + 2 * (pp - 1 - rank) + 1, v * m)
    elif schedule == "ZBVZeroBubble":
        chunks = min(2 * pp, 2 * m)
    else:
        chunks = min(2 * pp + 2, 2 * m)
    return PipelineShare(
        rank=rank,
        pp=pp,
        stages=rank_stages(schedule, pp, v, rank),
        in_flight=chunks,
        logits_in_flight=m if schedule == "GPipe" else 1,
    )
