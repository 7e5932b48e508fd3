"""Checkpointing: DCP checkpoints, exact resume, preemption."""

from plugtrain.exports import front_door

__getattr__, __dir__, __all__ = front_door(
    __name__,
    {
        "export": ["export_checkpoint", "parse_size"],
        "manager": ["CheckpointManager"],
        "rng": ["seed_generators"],
    },
)
