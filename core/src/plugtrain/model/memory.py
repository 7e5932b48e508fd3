"""A memory estimate's parts and table, and the activation checkpointing it assumes.

Each family's formula (``ModelSpec.memory``; the Llama one in ``model.llama.memory``) returns a
:class:`MemoryEstimate`: the bytes a training step holds at its peak on each process, by part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Checkpointing", "MemoryEstimate", "PipelineShare", "size_text"]


@dataclass(frozen=True)
class Checkpointing:
    """What activation checkpointing a run does: ``none``, ``full``, ``op`` (selective by op)
    or ``layer`` (selective by layer: every ``every``-th block in full)."""

    mode: Literal["none", "full", "op", "layer"] = "none"
    every: int = 1

    def describe(self) -> str:
        """In words, for the estimate's table."""
        return {
            "none": "no activation checkpointing",
            "full": "full activation checkpointing",
            "op": "selective activation checkpointing (by op)",
            "layer": f"selective activation checkpointing (every {self.every} blocks)",
        }[self.mode]


@dataclass(frozen=True)
class PipelineShare:
    """What one pipeline rank holds (``training.pipeline_plan.pipeline_share`` builds it):
    its stages of ``pp * len(stages)`` and the activations it keeps at its peak."""

    rank: int
    """Its place among the ``pp`` pipeline ranks."""
    pp: int
    """The pipeline ranks."""
    stages: tuple[int, ...]
    """The stages it holds (0 holds the embedding, the last the final norm and output)."""
    in_flight: int
    """Chunks (one stage's blocks for one microbatch) whose activations it keeps at its peak."""
    logits_in_flight: int
    """Microbatches whose logits the last stage keeps at once."""

    @property
    def num_stages(self) -> int:
        """Every stage of the pipeline."""
        return self.pp * len(self.stages)

    @property
    def first(self) -> bool:
        """Whether it holds the first stage (the embedding)."""
        return 0 in self.stages

    @property
    def last(self) -> bool:
        """Whether it holds the last stage (the final norm, the output and the loss)."""
        return self.num_stages - 1 in self.stages


@dataclass(frozen=True)
class MemoryEstimate:
    """The bytes each process holds at a step's peak, by part (see the module docstring)."""

    parts: tuple[tuple[str, int, str], ...]
    """(name, bytes, how it is counted) for each part, in the table's order."""
    setting: str
    """The run the estimate is for, in words."""
    notes: tuple[str, ...] = ()
    """Lines the table ends with (a pipeline's bubble and each rank's total)."""

    @property
    def total(self) -> int:
        """The sum of the parts, in bytes."""
        return sum(nbytes for _, nbytes, _ in self.parts)

    def table(self) -> str:
        """Each part, its size and how it is counted, then the total (several lines)."""
        width = max(len(name) for name, _, _ in self.parts)
        lines = [f"memory estimate per process: {self.setting}"]
        for name, nbytes, how in self.parts:
            lines.append(f"  {name:<{width}}  {size_text(nbytes):>10}  {how}")
        lines.append(f"  {'total':<{width}}  {size_text(self.total):>10}")
        lines.extend(self.notes)
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: the total, then each part."""
        parts = ", ".join(f"{name} {size_text(nbytes)}" for name, nbytes, _ in self.parts)
        return f"{size_text(self.total)} ({parts})"


def size_text(nbytes: int) -> str:
    """``nbytes`` in GiB (from 1 GiB) or MiB, as the table writes sizes."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"
