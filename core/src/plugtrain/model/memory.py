"""A memory estimate's parts and table, and the activation checkpointing it assumes.

Each family's formula (``ModelSpec.memory``; the Llama one in ``model.llama.memory``) returns a
:class:`MemoryEstimate`: the bytes a training step holds at its peak on each process, by part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Checkpointing", "MemoryEstimate"]


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
class MemoryEstimate:
    """The bytes each process holds at a step's peak, by part (see the module docstring)."""

    parts: tuple[tuple[str, int, str], ...]
    """(name, bytes, how it is counted) for each part, in the table's order."""
    setting: str
    """The run the estimate is for, in words."""

    @property
    def total(self) -> int:
        """The sum of the parts, in bytes."""
        return sum(nbytes for _, nbytes, _ in self.parts)

    def table(self) -> str:
        """Each part, its size and how it is counted, then the total (several lines)."""
        width = max(len(name) for name, _, _ in self.parts)
        lines = [f"memory estimate per process: {self.setting}"]
        for name, nbytes, how in self.parts:
            lines.append(f"  {name:<{width}}  {_size(nbytes):>10}  {how}")
        lines.append(f"  {'total':<{width}}  {_size(self.total):>10}")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: the total, then each part."""
        parts = ", ".join(f"{name} {_size(nbytes)}" for name, nbytes, _ in self.parts)
        return f"{_size(self.total)} ({parts})"


def _size(nbytes: int) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"
