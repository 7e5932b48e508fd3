"""``plugtrain inspect-data``: the first examples of a prepared folder or a data file, marked.

Each is printed as text and as ids, the tokens the loss trains on marked (green on a terminal,
between brackets otherwise); :mod:`plugtrain.data.examples` reads them as training does.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from typing import TYPE_CHECKING

from plugtrain import sample
from plugtrain.config import CHAT_LOSSES, CHAT_OVERLONG, DATA_FORMATS, TrainingConfig
from plugtrain.errors import ConfigError, DataError, MissingFileError

if TYPE_CHECKING:
    from plugtrain.data import DocumentStream, Example, Tokenizer

__all__ = ["add_parser", "run"]

FILE_OPTIONS = ("text_field", "format", "chat_template", "chat_overlong")
"""The options that say how a data file is read: a prepared folder was read when prepared."""
GREEN, RESET = "\x1b[1;32m", "\x1b[0m"
OPEN, CLOSE = "[[", "]]"


def add_parser(subparsers: argparse._SubParsersAction, summary: str) -> None:
    """``plugtrain inspect-data``'s parser, ``summary`` its line in ``plugtrain --help``."""
    parser = subparsers.add_parser(
        "inspect-data",
        help=summary,
        description="Print the first documents (conversations, for chat data) of a prepared "
        "folder or a data file, or with --rows the rows of seq_len + 1 tokens a run draws, as "
        "text and as ids, with the tokens the loss trains on marked: green on a terminal, "
        f"between {OPEN} and {CLOSE} otherwise. A data file is read as training reads it (chat "
        "data through its chat template, with the assistant mask and the cut at --seq-len), its "
        "first documents only.",
    )
    parser.add_argument(
        "path",
        metavar="PREPARED_OR_FILE",
        help="a folder written by plugtrain prepare-data, or a data file (sample:NAME: a file "
        "of the shipped sample, e.g. sample:chat_train.jsonl)",
    )
    parser.add_argument("-n", type=int, default=3, help="examples to print (default 3)")
    parser.add_argument("--skip", type=int, default=0, help="examples to skip first")
    parser.add_argument(
        "--rows", action="store_true", help="the packed rows a run draws instead of documents"
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=TrainingConfig.seq_len,
        help=f"training.seq_len: the rows' length; chat data in a file is cut (or dropped) "
        f"beyond it (default {TrainingConfig.seq_len})",
    )
    parser.add_argument(
        "--tokenizer",
        help="a tokenizer.json (default: a folder's own; for a file, sample:tokenizer.json)",
    )
    parser.add_argument(
        "--chat-loss",
        choices=CHAT_LOSSES,
        default="assistant",
        help="data.chat_loss: train on the assistant's tokens (default) or on all",
    )
    parser.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="mark with colour (auto: on a terminal, unless NO_COLOR is set) or brackets",
    )
    file = parser.add_argument_group("a data file (a prepared folder was read when prepared)")
    file.add_argument("--text-field", help="data.text_field (default: text)")
    file.add_argument("--format", choices=DATA_FORMATS, help="data.format (default: auto)")
    file.add_argument(
        "--chat-template", help="data.chat_template: a .jinja file (default: the tokenizer's)"
    )
    file.add_argument(
        "--chat-overlong", choices=CHAT_OVERLONG, help="data.chat_overlong (default: truncate)"
    )


def run(args: argparse.Namespace) -> int:
    """Print ``args.n`` examples of ``args.path``."""
    from plugtrain.data import document_examples, row_examples  # numpy, torch: not for --help

    for option, value, least in (
        ("-n", args.n, 1),
        ("--seq-len", args.seq_len, 1),
        ("--skip", args.skip, 0),
    ):
        if value < least:
            raise ConfigError(f"{option} must be >= {least}, got {value}")
    folder = sample.resolve(args.path).is_dir()
    stream, tokenizer = _open_folder(args) if folder else _open_file(args)
    loss_mask = args.chat_loss == "assistant"
    if args.rows:
        source = f"input '{args.path}'"
        examples = row_examples(
            stream, args.seq_len, args.skip, args.n, loss_mask=loss_mask, source=source
        )
        count = f"{stream.num_tokens // (args.seq_len + 1)} rows of seq_len={args.seq_len}"
    else:
        examples = document_examples(stream, args.skip, args.n, loss_mask=loss_mask)
        count = f"{stream.num_documents} documents"
    if not examples:  # a file is read until enough are: it has no more
        raise DataError(
            f"input '{args.path}' has {count}: --skip {args.skip} leaves none to show; lower --skip"
        )
    colour = args.color == "always" or (
        args.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    )
    print(_heading(args.path, stream, args.chat_loss, colour, read=not folder))
    for example in examples:
        print()
        print(_show(example, tokenizer, colour))
    return 0


def _open_folder(args: argparse.Namespace) -> tuple[DocumentStream, Tokenizer]:
    """The prepared folder ``args.path`` and its tokenizer (``--tokenizer``, checked, or the
    one its manifest names)."""
    from plugtrain.data import Tokenizer, TokenStore, file_sha256

    given = [f"--{k.replace('_', '-')}" for k in FILE_OPTIONS if getattr(args, k) is not None]
    if given:
        raise ConfigError(
            f"{given[0]} applies to a data file, but '{args.path}' is a prepared folder, "
            f"read when it was prepared: leave {given[0]} out, or give the data file"
        )
    store = TokenStore(sample.resolve(args.path), key="input")
    recorded = store.manifest["tokenizer"]
    if not args.tokenizer and not os.path.isfile(recorded["path"]):
        raise MissingFileError(
            f"'{args.path}' was prepared with tokenizer '{recorded['path']}', which is not "
            f"there now: give its tokenizer.json with --tokenizer"
        )
    tokenizer = Tokenizer.from_file(args.tokenizer or recorded["path"])
    if args.tokenizer and file_sha256(sample.resolve(args.tokenizer)) != recorded["sha256"]:
        raise DataError(
            f"--tokenizer '{args.tokenizer}' is not the tokenizer '{args.path}' was "
            f"prepared with ({recorded['path']}): leave --tokenizer out, or give that one"
        )
    return store, tokenizer


def _open_file(args: argparse.Namespace) -> tuple[DocumentStream, Tokenizer]:
    """The first documents of the data file ``args.path``, as many as the examples asked for
    need, and the tokenizer (``--tokenizer``, default the sample's)."""
    from plugtrain.data import ChatOptions, Tokenizer, read_head

    if not sample.resolve(args.path).exists():
        raise MissingFileError(
            f"input '{args.path}' not found: give a prepared folder or a data file"
        )
    tokenizer_path = sample.resolve(args.tokenizer or "sample:tokenizer.json")
    tokenizer = Tokenizer.from_file(tokenizer_path)
    chat = ChatOptions(
        args.format or "auto",
        args.chat_template or "",
        args.seq_len,
        args.chat_overlong or "truncate",
    )
    wanted = args.skip + args.n
    head = read_head(
        [args.path],
        tokenizer_path,
        text_field=args.text_field or "text",
        chat=chat,
        min_documents=0 if args.rows else wanted,
        min_tokens=wanted * (args.seq_len + 1) if args.rows else 0,
    )
    return head, tokenizer


def _heading(path: str, stream: DocumentStream, chat_loss: str, colour: bool, read: bool) -> str:
    """What the data is, which tokens are trained, and how they are marked; the counts are a
    prepared folder's, or those of the documents ``read`` from a file."""
    how = f"{GREEN}in green{RESET}" if colour else f"between {OPEN} and {CLOSE}"
    chat = stream.chat
    if chat is None:
        return f"{path}: text\ntrained: every token, {how}"
    sha = chat.get("template_record", {}).get("sha256", "")
    lines = [
        f"{path}: chat data, template {chat['template']}" + (f" (sha256 {sha[:12]})" * bool(sha))
    ]
    if chat["max_tokens"]:
        lines.append(
            f"of {chat['conversations']} conversations{' read' * read}, {chat['truncated']} cut at "
            f"{chat['max_tokens']} tokens and {chat['dropped']} dropped (data.chat_overlong)"
        )
    what = "the assistant's tokens" if chat_loss == "assistant" else "every token"
    lines.append(f"trained (data.chat_loss {chat_loss}): {what}, {how}")
    return "\n".join(lines)


def _marked(pieces: list[tuple[str, bool]], colour: bool, sep: str = "") -> str:
    """The texts of ``pieces`` joined by ``sep``, each trained one marked: green when
    ``colour``, else between brackets."""
    start, end = (GREEN, RESET) if colour else (OPEN, CLOSE)
    return sep.join(f"{start}{text}{end}" if trained else text for text, trained in pieces)


def _show(example: Example, tokenizer: Tokenizer, colour: bool) -> str:
    """The example's heading, text and ids, each run of trained tokens marked."""
    trained = example.trained.tolist()
    runs, at = [], 0
    for value, group in itertools.groupby(trained):
        length = len(list(group))
        runs.append((example.ids[at : at + length].tolist(), value))
        at += length
    text = _marked([(tokenizer.decode(ids), value) for ids, value in runs], colour)
    ids = _marked([(" ".join(map(str, ids)), value) for ids, value in runs], colour, sep=" ")
    heading = f"--- {example.name}: {len(trained)} tokens, {sum(trained)} trained ---"
    return f"{heading}\n{text}\nids: {ids}"
