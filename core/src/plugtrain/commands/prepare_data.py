"""``plugtrain prepare-data``: a corpus tokenized once into a prepared folder."""

from __future__ import annotations

import argparse

from plugtrain import sample
from plugtrain.config import CHAT_OVERLONG, DATA_FORMATS

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction, summary: str) -> None:
    """``plugtrain prepare-data``'s parser, ``summary`` its line in ``plugtrain --help``."""
    parser = subparsers.add_parser(
        "prepare-data",
        help=summary,
        description="Tokenize JSONL (.jsonl, .jsonl.gz, .jsonl.zst), Parquet and .txt files "
        "(files, folders or globs) into token shards, document boundaries and a manifest. "
        "Written to OUT.partial and renamed when complete; an up-to-date OUT is not redone. "
        "The bytes written do not depend on --workers. Parquet needs plugtrain[parquet], "
        "zstd plugtrain[zstd].",
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="a file, folder or glob")
    parser.add_argument("-o", "--output", required=True, help="the prepared folder to write")
    parser.add_argument(
        "--tokenizer",
        required=True,
        help="a tokenizers tokenizer.json (sample:tokenizer.json: the shipped sample's)",
    )
    parser.add_argument("--text-field", default="text", help="JSON key / Parquet column of text")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    parser.add_argument(
        "--shard-tokens", type=int, help="tokens per shard (default: 2^28, 512 MiB of uint16)"
    )
    parser.add_argument(
        "--format",
        choices=DATA_FORMATS,
        default="auto",
        help='chat: {"messages": [...]} per line; auto (default): chat if the first has them',
    )
    parser.add_argument(
        "--chat-template", default="", help="a .jinja template (default: the tokenizer folder's)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="chat data: conversations longer than this are cut or dropped (set training.seq_len)",
    )
    parser.add_argument(
        "--chat-overlong",
        choices=CHAT_OVERLONG,
        default="truncate",
        help="cut (default) or drop them",
    )


def run(args: argparse.Namespace) -> int:
    """Prepare the folder and say what it did, with its throughput."""
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
