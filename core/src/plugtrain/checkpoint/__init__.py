"""Checkpointing: DCP checkpoints, exact resume, preemption."""

from plugtrain.exports import front_door

__getattr__, __dir__, __all__ = front_door(
    __name__,
    {
        "dcp_io": ["read_checkpoint", "read_metadata"],
        "export": ["export_checkpoint", "parse_size"],
        "initial": ["InitialLoad", "initial_load_ignored", "open_initial_load"],
        "layout": ["CONFIG", "checkpoint_folder", "complete_checkpoints"],
        "manager": ["CheckpointManager"],
        "rng": ["seed_generators"],
        "saved": ["WEIGHTS", "open_checkpoint"],
    },
)
