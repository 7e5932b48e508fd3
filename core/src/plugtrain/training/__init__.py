"""The training loop: the trainer, its optimizer and schedule, the launch from a command line."""

from plugtrain.exports import front_door

__getattr__, __dir__, __all__ = front_door(
    __name__,
    {
        "estimate": ["estimate_run"],
        "launch": ["configure", "ends_quietly", "run_cli"],
        "trainer": ["Trainer", "cross_entropy"],
    },
)
