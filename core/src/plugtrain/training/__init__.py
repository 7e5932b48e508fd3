"""The training loop: the trainer, its optimizer and schedule, the launch from a command line."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugtrain.training.estimate import estimate_run as estimate_run
    from plugtrain.training.launch import configure as configure
    from plugtrain.training.launch import ends_quietly as ends_quietly
    from plugtrain.training.launch import run_cli as run_cli
    from plugtrain.training.trainer import Trainer as Trainer
else:
    from plugtrain.exports import front_door

    __getattr__, __dir__, __all__ = front_door(__name__, __file__)
