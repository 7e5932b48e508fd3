"""Train a Llama-style model with plugtrain.

    python train.py                                   # the debug model on the Shakespeare sample
    python train.py --config configs/debug.toml --training.steps 50
    torchrun --nproc_per_node=2 train.py --config configs/debug.toml
    python train.py --help                            # every config field, with its docs

The loop is plugtrain.training.trainer.Trainer; plugins enabled in the config hook into each step.
"""

import sys

from plugtrain.distributed import destroy_world
from plugtrain.training.launch import configure, run_cli
from plugtrain.training.trainer import Trainer


def main() -> None:
    configured = configure(sys.argv[1:])
    if configured is None:  # --help
        return
    config, host = configured
    Trainer(config, host).run()  # on an error, run_cli reports it and exits
    destroy_world()


if __name__ == "__main__":
    sys.exit(run_cli(main))
