"""Checkpointing: DCP checkpoints, exact resume, preemption."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugtrain.checkpoint.base import base_loader as base_loader
    from plugtrain.checkpoint.dcp_io import read_checkpoint as read_checkpoint
    from plugtrain.checkpoint.dcp_io import read_metadata as read_metadata
    from plugtrain.checkpoint.export import export_adapter as export_adapter
    from plugtrain.checkpoint.export import export_checkpoint as export_checkpoint
    from plugtrain.checkpoint.export import parse_size as parse_size
    from plugtrain.checkpoint.export import unexported_bias as unexported_bias
    from plugtrain.checkpoint.initial import InitialLoad as InitialLoad
    from plugtrain.checkpoint.initial import initial_load_ignored as initial_load_ignored
    from plugtrain.checkpoint.initial import open_initial_load as open_initial_load
    from plugtrain.checkpoint.layout import CONFIG as CONFIG
    from plugtrain.checkpoint.layout import checkpoint_folder as checkpoint_folder
    from plugtrain.checkpoint.layout import complete_checkpoints as complete_checkpoints
    from plugtrain.checkpoint.manager import CheckpointManager as CheckpointManager
    from plugtrain.checkpoint.rng import seed_generators as seed_generators
    from plugtrain.checkpoint.saved import WEIGHTS as WEIGHTS
    from plugtrain.checkpoint.saved import SavedCheckpoint as SavedCheckpoint
    from plugtrain.checkpoint.saved import locate_checkpoint as locate_checkpoint
    from plugtrain.checkpoint.saved import open_checkpoint as open_checkpoint
    from plugtrain.checkpoint.storage import CheckpointStorage as CheckpointStorage
else:
    from plugtrain.exports import front_door

    __getattr__, __dir__, __all__ = front_door(__name__, __file__)
