"""The plugtrain command: train, look at the installed plugins and finished runs, prepare data.

  plugtrain train [--config FILE|NAME] [--section.key VALUE ...] [--nproc-per-node N]  # train
  plugtrain plugins [--config FILE] [--plugins.enabled NAMES]  # installed plugins, their hooks
  plugtrain plot RUN_DIR [RUN_DIR ...] [-o metrics.png]        # draw and compare runs
  plugtrain prepare-data INPUT [INPUT ...] -o OUT --tokenizer FILE  # tokenize a corpus once
  plugtrain inspect-data PREPARED_OR_FILE [-n 3] [--rows]     # examples, trained tokens marked
  plugtrain estimate CONFIG [--gpus N] [--tp T] [--section.key VALUE ...]  # memory per GPU
  plugtrain export-hf PATH -o OUT [--dtype auto] [--weights model|ema]  # Hugging Face folder
  plugtrain generate PATH --prompt TEXT                        # what a saved model writes
  plugtrain eval PATH --tasks FILE [FILE ...] [-o scores.json]  # downstream tasks' accuracy

With no arguments, plugtrain train trains the debug model on the Shakespeare sample shipped
with plugtrain; --config debug names the shipped configs/debug.toml.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from types import ModuleType

from plugtrain.training import ends_quietly, run_cli

__all__ = ["COMMANDS", "Command", "command", "main"]


@dataclass(frozen=True)
class Command:
    """A sub-command: the module that parses and runs it, and its line in ``--help``."""

    module: str
    summary: str


COMMANDS = {
    "train": Command("plugtrain.commands.train", "train a model (train --help: every field)"),
    "plugins": Command(
        "plugtrain.commands.plugins", "list installed plugins and the hooks they implement"
    ),
    "plot": Command(
        "plugtrain.commands.plot",
        "draw loss, grad_norm, loss_scale and throughput of one or several runs",
    ),
    "prepare-data": Command(
        "plugtrain.commands.prepare_data",
        "tokenize documents into a prepared folder that training reads by memory map",
    ),
    "inspect-data": Command(
        "plugtrain.commands.inspect_data",
        "print examples as training sees them, text and ids, the trained tokens marked",
    ),
    "estimate": Command(
        "plugtrain.commands.estimate", "estimate the memory each GPU needs to train a config"
    ),
    "export-hf": Command(
        "plugtrain.commands.export_hf",
        "write a checkpoint as a Hugging Face Llama folder (safetensors, config, tokenizer)",
    ),
    "generate": Command(
        "plugtrain.commands.generate", "print what a saved model writes after a prompt"
    ),
    "eval": Command(
        "plugtrain.commands.eval", "score multiple-choice tasks (acc, acc_norm) on a saved model"
    ),
}
"""Every sub-command by name, in ``--help``'s order. A command's module is imported only when
it runs (or prints its own help): ``plugtrain --help`` imports none, and no torch."""


def _load(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name].module)


def main(argv: list[str] | None = None) -> int:
    """Run the plugtrain command line ``argv`` (default: this process's) and return its exit
    status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # its arguments go as they are: argparse must not see them
        return _load("train").train(argv[1:], prog="plugtrain train")
    return ends_quietly(lambda: command(argv))


def command(argv: list[str]) -> int:
    """Run every sub-command but ``train`` (whose arguments argparse must not see)."""
    # Raw: the description's command lines must stay one per line, not be refilled.
    parser = argparse.ArgumentParser(
        prog="plugtrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = argv[0] if argv[:1] and argv[0] in COMMANDS else None
    for name, entry in COMMANDS.items():
        if name == chosen:
            _load(name).add_parser(sub, entry.summary)
        else:  # its line in --help; its parser is built only when it runs
            sub.add_parser(name, help=entry.summary, add_help=False)
    args, rest = parser.parse_known_args(argv)  # exits unless the command is ``chosen``
    module = _load(args.command)
    # Only plugins and estimate take config options; the others their own options only.
    if rest and not getattr(module, "TAKES_CONFIG", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.config_args = rest
    return run_cli(lambda: module.run(args))


if __name__ == "__main__":
    sys.exit(main())
