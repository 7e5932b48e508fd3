"""The training loop: the trainer, its step, loss, data and validation, optimizer and schedule."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugtrain.training.conversion import converted_model as converted_model
    from plugtrain.training.conversion import fire_convert_model as fire_convert_model
    from plugtrain.training.conversion import saved_conversion as saved_conversion
    from plugtrain.training.conversion import (
        trainable_named_parameters as trainable_named_parameters,
    )
    from plugtrain.training.estimate import estimate_run as estimate_run
    from plugtrain.training.launch import configure as configure
    from plugtrain.training.launch import ends_quietly as ends_quietly
    from plugtrain.training.launch import run_cli as run_cli
    from plugtrain.training.launcher import check_world as check_world
    from plugtrain.training.launcher import launch_job as launch_job
    from plugtrain.training.launcher import split_launch_options as split_launch_options
    from plugtrain.training.loss import RunLoss as RunLoss
    from plugtrain.training.run_data import open_training_data as open_training_data
    from plugtrain.training.step import StepRunner as StepRunner
    from plugtrain.training.trainer import Trainer as Trainer
    from plugtrain.training.validation import Validation as Validation
else:
    from plugtrain.exports import front_door

    __getattr__, __dir__, __all__ = front_door(__name__, __file__)
