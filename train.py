"""Train a Llama-style model with plugtrain: what ``plugtrain train`` does, from a checkout.

    python train.py                                   # the debug model on the Shakespeare sample
    python train.py --config configs/debug.toml --training.steps 50
    python train.py --nproc-per-node 2 --config configs/debug.toml  # 2 processes, checked first
    torchrun --nproc_per_node=2 train.py --config configs/debug.toml
    python train.py --help                            # every config field, with its docs

The loop is plugtrain.training.trainer.Trainer; plugins enabled in the config hook into each step.
"""

import sys

from plugtrain.commands.train import train

if __name__ == "__main__":
    sys.exit(train(sys.argv[1:]))
