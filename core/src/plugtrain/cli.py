"""The plugtrain command: train, look at the installed plugins and finished runs, prepare data.

  plugtrain train [--config FILE|NAME] [--section.key VALUE ...]  # train; --help: every field
  plugtrain plugins [--config FILE] [--plugins.enabled NAMES]  # installed plugins, their hooks
  plugtrain plot RUN_DIR [RUN_DIR ...] [-o metrics.png]        # draw and compare runs
  plugtrain prepare-data INPUT [INPUT ...] -o OUT --tokenizer FILE  # tokenize a corpus once
  plugtrain estimate CONFIG [--gpus N] [--tp T] [--section.key VALUE ...]  # memory per GPU
  plugtrain export-hf PATH -o OUT [--dtype auto] [--weights model|ema]  # Hugging Face folder
  plugtrain generate PATH --prompt TEXT                        # what a saved model writes
  plugtrain eval PATH --tasks FILE [FILE ...] [-o scores.json]  # downstream tasks' accuracy

With no arguments, plugtrain train trains the debug model on the Shakespeare sample shipped
with plugtrain; --config debug names the shipped configs/debug.toml.
"""

from __future__ import annotations

import argparse
import sys

from plugtrain import sample
from plugtrain.config import (
    CHAT_OVERLONG,
    DATA_FORMATS,
    enabled_plugins,
    merged_values,
    parse_command_line,
)
from plugtrain.host import PluginHost, installed_plugins
from plugtrain.observability import plot_runs
from plugtrain.training import configure, ends_quietly, run_cli


def train(argv: list[str], prog: str = "train.py") -> int:
    """Run the training command line ``argv`` (``train.py``'s, ``plugtrain train``'s) and
    return its exit status; ``prog`` names the command in ``--help``."""

    def main() -> None:
        configured = configure(argv, prog)
        if configured is None:  # --help
            return
        # Here, not at the top: --help and a config error need no torch (seconds to import).
        from plugtrain.distributed import destroy_world
        from plugtrain.training import Trainer

        config, host = configured
        Trainer(config, host).run()  # on an error, run_cli reports it and exits
        destroy_world()

    return ends_quietly(lambda: run_cli(main))


def list_plugins(config_args: list[str]) -> int:
    """Print every installed plugin: enabled or not, distribution, version, hooks.

    Only enabled plugins are imported (to list their hooks); the others are described from
    their distribution's metadata alone. A name that several distributions provide gets one
    row per distribution, marked as clashing, and none of them is imported.
    """
    enabled = enabled_plugins(merged_values(parse_command_line(config_args)))
    installed = installed_plugins()
    host = PluginHost()
    # A clashing name cannot be loaded; listing the clash is what this command is for.
    host.load_enabled([name for name in enabled if len(installed.get(name, ())) < 2])
    rows = [("plugin", "enabled", "distribution", "version", "hooks")]
    for name, providers in sorted(installed.items()):
        on = name in enabled
        for plugin in providers:
            if len(providers) > 1:
                others = ", ".join(f"'{p.distribution}'" for p in providers if p is not plugin)
                hooks = f"(clash: '{name}' is also provided by {others}; uninstall one)"
            elif on:
                hooks = ", ".join(host.hooks_of(name))
            else:
                hooks = f"(not loaded: {plugin.value})"
            rows.append((name, "yes" if on else "no", plugin.distribution, plugin.version, hooks))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[4])
    return 0


def prepare_data(args: argparse.Namespace) -> int:
    """Run ``plugtrain prepare-data`` and say what it did, with its throughput."""
    # numpy, tokenizers: not for --help. The function, unlike SHARD_TOKENS, cannot pass the
    # front door: the module of the same name hides it.
    from plugtrain.data import SHARD_TOKENS, ChatOptions
    from plugtrain.data.prepare import prepare

    chat = ChatOptions(args.format, args.chat_template, args.max_tokens, args.chat_overlong)
    result = prepare(
        args.inputs,
        args.output,
        sample.resolve(args.tokenizer),
        text_field=args.text_field,
        workers=args.workers,
        shard_tokens=SHARD_TOKENS if args.shard_tokens is None else args.shard_tokens,
        chat=chat,
    )
    if not result.written:
        print(f"{result.folder} is up to date ({result.num_tokens} tokens): nothing to do")
        return 0
    print(
        f"wrote {result.folder}: {result.num_tokens} tokens in {result.seconds:.1f} s "
        f"({result.input_bytes / 1e6 / result.seconds:.1f} MB/s, "
        f"{result.num_tokens / 1e6 / result.seconds:.2f}M tokens/s)"
    )
    return 0


def print_estimate(args: argparse.Namespace, overrides: list[str]) -> None:
    """Print the memory estimate of ``args.config`` (with ``overrides``) on ``args.gpus``."""
    from plugtrain.training import estimate_run  # lazy: only this command needs it

    tp = [] if args.tp is None else ["--parallelism.tp", str(args.tp)]
    configured = configure(["--config", args.config, *tp, *overrides])
    assert configured is not None  # no --help among the overrides: argparse took it
    print(estimate_run(configured[0], args.gpus).table())


def export_hf(args: argparse.Namespace) -> int:
    """Run ``plugtrain export-hf`` and say what it wrote."""
    import torch

    from plugtrain.checkpoint import export_checkpoint, parse_size

    folder, dtype = export_checkpoint(
        args.path,
        args.output,
        dtype=None if args.dtype == "auto" else getattr(torch, args.dtype),
        weights=args.weights,
        max_shard_size=parse_size(args.max_shard_size),
        overwrite=args.overwrite,
        tokenizer=args.tokenizer,
    )
    kept = " (the checkpoint's)" if args.dtype == "auto" else ""
    name = str(dtype).removeprefix("torch.")
    print(f"wrote {args.output}: the {args.weights} weights of {folder} in {name}{kept}")
    return 0


def generate(args: argparse.Namespace) -> int:
    """Run ``plugtrain generate`` (its module, and the checkpoint reader, load only here)."""
    from plugtrain.generate import run

    return run(args)


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser(
        "generate",
        help="print what a saved model writes after a prompt",
        description="Load the model of a run's dump folder (its latest checkpoint), of a "
        "checkpoints/step-N folder or of an exported Hugging Face folder and print the text it "
        "writes after --prompt, up to its end-of-text token. Greedy by default; --temperature "
        "> 0 samples.",
    )
    gen.add_argument(
        "path",
        metavar="PATH",
        help="a run's dump folder or step-N folder (or its s3:// URL), or a Hugging Face folder",
    )
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user message, rendered with the model's chat template",
    )
    gen.add_argument("--max-new-tokens", type=int, default=100, help="at most this many tokens")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    gen.add_argument("--seed", type=int, default=None, help="seed of the sampling generator")
    gen.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: a GPU if any)")
    gen.add_argument(
        "--weights", choices=("model", "ema"), default="model", help="ema: the ema plugin's average"
    )
    gen.add_argument(
        "--tokenizer", default=None, help="a tokenizer.json, or sample:NAME (default: the run's)"
    )


def evaluate(args: argparse.Namespace) -> int:
    """Run ``plugtrain eval`` (its module, and the model loaders, load only here)."""
    from plugtrain.eval_command import run

    return run(args)


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser(
        "eval",
        help="score multiple-choice tasks (acc, acc_norm) on a saved model",
        description="Score the multiple-choice tasks of JSONL files ({context, choices, gold}, "
        "or HellaSwag's own validation file) on the model of a run's dump folder (its latest "
        "checkpoint), of a checkpoints/step-N folder or of an exported Hugging Face folder, as "
        "the downstream_eval plugin does during training. Under torchrun the items are split "
        "over the processes. Prints a table; -o writes the scores as JSON.",
    )
    ev.add_argument(
        "path",
        metavar="PATH",
        help="a run's dump folder or step-N folder (or its s3:// URL), or a Hugging Face folder",
    )
    ev.add_argument(
        "--tasks", nargs="+", required=True, metavar="FILE",
        help="task files (sample:cloze.jsonl: the shipped Shakespeare cloze)",
    )  # fmt: skip
    ev.add_argument("-o", "--output", help="write the scores to this JSON file")
    ev.add_argument(
        "--max-items", type=int, default=0, help="items per task, evenly spaced (0: all)"
    )
    ev.add_argument("--batch-size", type=int, default=32, help="sequences per forward (default 32)")
    ev.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="default: a GPU if any"
    )
    ev.add_argument(
        "--weights", choices=("model", "ema"), default="model", help="ema: the ema plugin's average"
    )
    ev.add_argument(
        "--tokenizer", default=None, help="a tokenizer.json, or sample:NAME (default: the run's)"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the plugtrain command line ``argv`` (default: this process's) and return its exit
    status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        return train(argv[1:], prog="plugtrain train")
    return ends_quietly(lambda: command(argv))


def command(argv: list[str]) -> int:
    """Run every sub-command but ``train`` (whose arguments argparse must not see)."""
    # Raw: the description's command lines must stay one per line, not be refilled.
    parser = argparse.ArgumentParser(
        prog="plugtrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # Its arguments go to train() as they are: argparse must neither read nor reorder them.
    sub.add_parser("train", add_help=False, help="train a model (train --help: every field)")
    sub.add_parser(
        "plugins",
        usage="plugtrain plugins [-h] [--config FILE] [--plugins.enabled NAMES]",
        help="list installed plugins and the hooks they implement",
        description="List every installed plugin: whether it is enabled, its distribution, "
        "version and hooks. Takes --config FILE and --plugins.enabled NAMES, as train.py does, "
        "to know which plugins are enabled; only those are imported. A name that several "
        "distributions provide gets one row per distribution, marked as clashing.",
    )
    plot = sub.add_parser(
        "plot",
        help="draw loss, grad_norm, loss_scale and throughput of one or several runs",
        description="Reads each run's metrics.jsonl; needs matplotlib (plugtrain[plot]).",
    )
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's dump folder")
    plot.add_argument(
        "-o",
        "--output",
        help="image file (.png, .svg, .pdf); default: metrics.png in the first run's folder",
    )
    data = sub.add_parser(
        "prepare-data",
        help="tokenize documents into a prepared folder that training reads by memory map",
        description="Tokenize JSONL (.jsonl, .jsonl.gz, .jsonl.zst), Parquet and .txt files "
        "(files, folders or globs) into token shards, document boundaries and a manifest. "
        "Written to OUT.partial and renamed when complete; an up-to-date OUT is not redone. "
        "The bytes written do not depend on --workers. Parquet needs plugtrain[parquet], "
        "zstd plugtrain[zstd].",
    )
    data.add_argument("inputs", nargs="+", metavar="INPUT", help="a file, folder or glob")
    data.add_argument("-o", "--output", required=True, help="the prepared folder to write")
    data.add_argument(
        "--tokenizer",
        required=True,
        help="a tokenizers tokenizer.json (sample:tokenizer.json: the shipped sample's)",
    )
    data.add_argument("--text-field", default="text", help="JSON key / Parquet column of text")
    data.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    data.add_argument(
        "--shard-tokens", type=int, help="tokens per shard (default: 2^28, 512 MiB of uint16)"
    )
    data.add_argument(
        "--format",
        choices=DATA_FORMATS,
        default="auto",
        help='chat: {"messages": [...]} per line; auto (default): chat if the first has them',
    )
    data.add_argument(
        "--chat-template", default="", help="a .jinja template (default: the tokenizer folder's)"
    )
    data.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="chat data: conversations longer than this are cut or dropped (set training.seq_len)",
    )
    data.add_argument(
        "--chat-overlong",
        choices=CHAT_OVERLONG,
        default="truncate",
        help="cut (default) or drop them",
    )
    estimate = sub.add_parser(
        "estimate",
        help="estimate the memory each GPU needs to train a config",
        description="Parameters, gradients, optimizer state, activations and logits per process "
        "for CONFIG on --gpus processes, with --section.key VALUE overrides as train.py takes "
        "them. The formulas are in plugtrain/model/llama/memory.py.",
    )
    estimate.add_argument("config", metavar="CONFIG", help="a TOML config")
    estimate.add_argument("--gpus", type=int, default=1, help="processes in all (default 1)")
    estimate.add_argument(
        "--tp", type=int, help="tensor-parallel degree (default: the config's parallelism.tp)"
    )
    export = sub.add_parser(
        "export-hf",
        help="write a checkpoint as a Hugging Face Llama folder (safetensors, config, tokenizer)",
        description="Write the latest checkpoint of a run (PATH: its dump folder) or one "
        "step-N folder as a folder that transformers' LlamaForCausalLM and AutoTokenizer load "
        "with no other file. Reads one tensor at a time; written to OUT.partial and renamed "
        "when complete.",
    )
    export.add_argument(
        "path", metavar="PATH", help="a run's dump folder or a step-N folder, or its s3:// URL"
    )
    export.add_argument("-o", "--output", required=True, help="the folder to write")
    export.add_argument(
        "--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
        help="dtype of every floating tensor (default: auto, the checkpoint's, float32 for a "
        "run's weights)",
    )  # fmt: skip
    export.add_argument(
        "--weights", default="model", choices=("model", "ema"),
        help="the trained weights, or the ema plugin's average (default: model)",
    )  # fmt: skip
    export.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors file (default: 5GB)"
    )
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    export.add_argument(
        "--tokenizer", help="the run's tokenizer.json (default: the one its config names)"
    )
    add_generate_parser(sub)
    add_eval_parser(sub)
    args, rest = parser.parse_known_args(argv)
    if args.command == "estimate":
        if args.gpus < 1:
            parser.error(f"--gpus must be >= 1, got {args.gpus}")
        if args.tp is not None and args.tp < 1:
            parser.error(f"--tp must be >= 1, got {args.tp}")
        return run_cli(lambda: print_estimate(args, rest))
    # Only plugins (and estimate, above) take config overrides; the others their options only.
    if rest and args.command != "plugins":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "export-hf":
        return run_cli(lambda: export_hf(args))
    if args.command == "prepare-data":
        return run_cli(lambda: prepare_data(args))
    if args.command == "generate":
        return run_cli(lambda: generate(args))
    if args.command == "eval":
        return run_cli(lambda: evaluate(args))
    if args.command == "plot":
        return run_cli(lambda: print(f"wrote {plot_runs(args.runs, args.output)}"))
    return run_cli(lambda: list_plugins(rest))


if __name__ == "__main__":
    sys.exit(main())
