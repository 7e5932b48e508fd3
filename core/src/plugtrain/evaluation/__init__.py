"""Evaluation: downstream tasks scored on a model, for ``downstream_eval`` and ``plugtrain eval``.

The ``downstream_eval`` plugin reaches the scorer through the plugin API, which re-exports it.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from plugtrain.evaluation.multiple_choice import EncodedTasks as EncodedTasks
    from plugtrain.evaluation.multiple_choice import Item as Item
    from plugtrain.evaluation.multiple_choice import ItemScore as ItemScore
    from plugtrain.evaluation.multiple_choice import Score as Score
    from plugtrain.evaluation.multiple_choice import Task as Task
    from plugtrain.evaluation.multiple_choice import encode_pair as encode_pair
    from plugtrain.evaluation.multiple_choice import encode_tasks as encode_tasks
    from plugtrain.evaluation.multiple_choice import loglikelihoods as loglikelihoods
    from plugtrain.evaluation.multiple_choice import read_task as read_task
    from plugtrain.evaluation.multiple_choice import score as score
    from plugtrain.evaluation.multiple_choice import score_items as score_items
    from plugtrain.evaluation.multiple_choice import wilson_interval as wilson_interval
    from plugtrain.evaluation.samples import sample_records as sample_records
else:
    from plugtrain.exports import front_door

    __getattr__, __dir__, __all__ = front_door(__name__, __file__)
