"""Checkpointing: DCP checkpoints, exact resume, preemption."""
