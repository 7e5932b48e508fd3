"""``plugtrain export-hf``: a checkpoint written as a Hugging Face Llama folder."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction, summary: str) -> None:
    """``plugtrain export-hf``'s parser, ``summary`` its line in ``plugtrain --help``."""
    parser = subparsers.add_parser(
        "export-hf",
        help=summary,
        description="Write the latest checkpoint of a run (PATH: its dump folder) or one "
        "step-N folder as a folder that transformers' LlamaForCausalLM and AutoTokenizer load "
        "with no other file. Reads one tensor at a time; written to OUT.partial and renamed "
        "when complete.",
    )
    parser.add_argument(
        "path", metavar="PATH", help="a run's dump folder or a step-N folder, or its s3:// URL"
    )
    parser.add_argument("-o", "--output", required=True, help="the folder to write")
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
        help="dtype of every floating tensor (default: auto, the checkpoint's, float32 for a "
        "run's weights)",
    )  # fmt: skip
    parser.add_argument(
        "--weights", default="model", choices=("model", "ema"),
        help="the trained weights, or the ema plugin's average (default: model)",
    )  # fmt: skip
    parser.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors file (default: 5GB)"
    )
    parser.add_argument(
        "--adapter", action="store_true",
        help="write the adapter alone (a LoRA run's: a peft folder, adapter_config.json and "
        "adapter_model.safetensors), not the merged model",
    )  # fmt: skip
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    parser.add_argument(
        "--tokenizer", help="the run's tokenizer.json (default: the one its config names)"
    )


def run(args: argparse.Namespace) -> int:
    """Export the checkpoint and say what it wrote."""
    import torch  # here: the parser, for --help, needs none of it

    from plugtrain.checkpoint import (
        export_adapter,
        export_checkpoint,
        open_checkpoint,
        parse_size,
        unexported_bias,
    )
    from plugtrain.training import saved_conversion

    # The export rules of parameters a plugin added: its run's plugins convert the model again.
    saved = open_checkpoint(args.path, args.tokenizer)
    conversion = saved_conversion(saved, args.weights)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    kept = " (the checkpoint's)" if args.dtype == "auto" else ""
    if args.adapter:
        folder, dtype = export_adapter(
            args.path,
            args.output,
            dtype=dtype,
            weights=args.weights,
            overwrite=args.overwrite,
            tokenizer=args.tokenizer,
            conversion=conversion,
        )
        name = str(dtype).removeprefix("torch.")
        print(f"wrote {args.output}: the adapter of the {args.weights} weights of {folder} in "
              f"{name}{kept}")  # fmt: skip
        return 0
    folder, dtype = export_checkpoint(
        args.path,
        args.output,
        dtype=dtype,
        weights=args.weights,
        max_shard_size=parse_size(args.max_shard_size),
        overwrite=args.overwrite,
        tokenizer=args.tokenizer,
        conversion=conversion,
    )
    name = str(dtype).removeprefix("torch.")
    print(f"wrote {args.output}: the {args.weights} weights of {folder} in {name}{kept}")
    if lost := unexported_bias(saved):
        print(f"export-hf: warning: {lost}", file=sys.stderr)
    return 0
