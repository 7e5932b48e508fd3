"""Multiple-choice downstream tasks: task files, log-likelihood scoring, ``acc`` and ``acc_norm``.

The one scorer of plugtrain: the ``downstream_eval`` plugin calls it on the model being trained
(FSDP2-sharded, tensor-parallel or neither) at each validation, and ``plugtrain eval`` on a
saved model. It scores as lm-evaluation-harness scores a ``multiple_choice`` task:

* each choice's log-likelihood is the sum of the log-probabilities of its continuation's tokens
  given the context. The continuation is ``delimiter + choice`` (``delimiter`` is " " unless an
  item says otherwise, lm-eval's ``target_delimiter``); trailing whitespace of the context moves
  to the front of the continuation; ``context + continuation`` is tokenized as a whole and split
  at the length of the tokenized context (lm-eval's ``_encode_pair``). The context starts with
  the tokenizer's BOS token when it has one, as training documents do and as the exported
  tokenizer adds it for lm-eval (an empty context is that token alone, or EOS without BOS, as
  lm-eval conditions it). A sequence longer than the model's ``max_seq_len`` keeps its last
  tokens (lm-eval truncates on the left too).
* ``acc``: the choice of highest log-likelihood is the gold one; ``acc_norm``: the same with each
  log-likelihood divided by its choice's length in characters (``len(choice)``, without the
  delimiter). Ties go to the first choice (``argmax``).
* a choice is greedy (lm-eval's ``is_greedy``) when each of its tokens is the model's most
  likely one there.

A task is a JSONL file, one item per line: ``{"context": str, "choices": [str, ...], "gold":
int}``, optionally ``"delimiter": str``. A line with ``ctx``/``ctx_a``, ``endings`` and ``label``
is read as HellaSwag's own validation file (``hellaswag_val.jsonl``) and preprocessed as
lm-eval's ``hellaswag`` task does: context ``activity_label + ": " + ctx_a + " " +
ctx_b.capitalize()`` (``ctx`` when ``ctx_a``/``ctx_b`` are absent), and for the context and each
ending: strip, `` [title]`` becomes ``". "``, every other ``[...]`` is removed, double spaces
become single.

Items are split over ranks (item ``i`` on rank ``i % world_size``); each rank forwards its
choices in batches of rows padded on the right (causal attention: padding changes nothing
before it), and every rank runs the same number of forwards, padding with a one-token one, so
that every rank joins each of an FSDP2 model's all-gathers. Each choice's log-likelihood is
summed in over the ranks (each is one rank's, so the sum is exact): every rank then holds every
item's (:func:`score_items`), and the score is the same on any number of processes. Under
tensor parallelism the ranks of a ``tp`` group score the same items together (the split is over
the data-parallel ranks, the ``group`` of :func:`score`), each reading the logits whole
(:func:`~plugtrain.model.tensor_parallel.whole_logits`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from plugtrain import sample
from plugtrain.errors import DataError, MissingFileError
from plugtrain.model import TextTokenizer, reshard, whole_logits

__all__ = [
    "EncodedTasks",
    "Item",
    "ItemScore",
    "Score",
    "Task",
    "encode_pair",
    "encode_tasks",
    "loglikelihoods",
    "read_task",
    "score",
    "score_items",
    "wilson_interval",
]

DELIMITER = " "
"""What separates the context from a choice unless an item says otherwise (lm-eval's
``target_delimiter``)."""


@dataclass(frozen=True)
class Item:
    """One multiple-choice question."""

    context: str
    choices: tuple[str, ...]
    gold: int
    """Index of the right choice."""
    delimiter: str = DELIMITER


@dataclass(frozen=True)
class Task:
    """A task file's items, named after the file (``cloze`` for ``sample:cloze.jsonl``)."""

    name: str
    path: str
    items: tuple[Item, ...]


def _hellaswag_text(text: str) -> str:
    """lm-eval's preprocessing of HellaSwag's texts (WikiHow's bracketed artifacts)."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _item(doc: object, where: str) -> Item:
    """The item of one parsed line; ``where`` names the line in errors."""
    if not isinstance(doc, dict):
        raise DataError(f"{where} is not a JSON object: write one item per line")
    if "endings" in doc:  # HellaSwag's own format
        missing = [k for k in ("endings", "label") if k not in doc]
        if "ctx" not in doc and not {"ctx_a", "ctx_b"} <= doc.keys():
            missing.append("ctx")
        if missing:
            raise DataError(
                f"{where} (a HellaSwag line) has no '{missing[0]}': give ctx (or ctx_a and "
                "ctx_b), endings and label"
            )
        if {"ctx_a", "ctx_b"} <= doc.keys():
            ctx = f"{doc['ctx_a']} {str(doc['ctx_b']).capitalize()}"
        else:
            ctx = str(doc["ctx"])
        if doc.get("activity_label"):
            ctx = f"{doc['activity_label']}: {ctx}"
        context, choices, gold = _hellaswag_text(ctx), doc["endings"], doc["label"]
        if isinstance(choices, list):
            choices = [_hellaswag_text(c) if isinstance(c, str) else c for c in choices]
        if isinstance(gold, str) and gold.strip().isdigit():
            gold = int(gold)
        delimiter = DELIMITER
    else:
        missing = [k for k in ("context", "choices", "gold") if k not in doc]
        if missing:
            raise DataError(
                f'{where} has no \'{missing[0]}\': write {{"context": ..., "choices": [...], '
                '"gold": N}, or a HellaSwag line (ctx, endings, label)'
            )
        context, choices, gold = doc["context"], doc["choices"], doc["gold"]
        delimiter = doc.get("delimiter", DELIMITER)
        if not isinstance(context, str) or not isinstance(delimiter, str):
            raise DataError(f"{where}: 'context' and 'delimiter' must be strings")
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise DataError(f"{where}: the choices must be a list of strings")
    if len(choices) < 2:
        raise DataError(f"{where} has {len(choices)} choice(s): give at least 2")
    if not all(choices):
        raise DataError(f"{where}: choice {choices.index('')} is empty: every choice needs text")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise DataError(
            f"{where}: gold {gold!r} is not the index of one of its {len(choices)} choices "
            f"(0 to {len(choices) - 1})"
        )
    return Item(context, tuple(choices), gold, delimiter)


def read_task(path: str) -> Task:
    """The task in JSONL file ``path`` (``sample:NAME`` names a file of the shipped sample).

    Bad input raises a one-line :class:`~plugtrain.errors.UserError` naming the file and line.
    """
    file = sample.resolve(path)
    if not file.is_file():
        raise MissingFileError(f"task file '{path}' not found: give an existing JSONL file")
    items = []
    with file.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"task file '{path}' line {number}"
            try:
                doc = json.loads(line)
            except ValueError as e:
                raise DataError(f"{where} is not valid JSON ({e.msg}): fix or remove it") from e
            items.append(_item(doc, where))
    if not items:
        raise DataError(f"task file '{path}' holds no item: write one JSON object per line")
    name = Path(file.name.removesuffix(".gz")).stem
    return Task(name, path, tuple(items))


def encode_pair(
    tokenizer: TextTokenizer, context: str, continuation: str
) -> tuple[list[int], list[int]]:
    """The context's tokens and the continuation's, split as lm-eval's ``loglikelihood`` splits
    them with a Hugging Face tokenizer that adds BOS (plugtrain's export): an empty context is
    the BOS token alone (EOS without BOS; a continuation that starts with that token gives it
    up); otherwise the context's trailing whitespace joins the continuation, ``context +
    continuation`` is tokenized whole after BOS (none when the text starts with BOS's own text)
    and cut at the length of the tokenized context (lm-eval's ``_encode_pair``)."""
    if not context:
        first = tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id
        ids = tokenizer.encode(continuation)
        return ([first], ids) if ids[:1] != [first] else (ids[:1], ids[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    bos = tokenizer.bos_id
    prefix = [] if bos is None or context.startswith(tokenizer.decode([bos])) else [bos]
    if not prefix and not context:
        prefix = [tokenizer.eos_id]  # a context of spaces: a token for the first to follow
    context_ids = prefix + tokenizer.encode(context)
    whole = prefix + tokenizer.encode(context + continuation)
    return context_ids, whole[len(context_ids) :]


@dataclass
class EncodedTasks:
    """Tasks tokenized for one model: one row of tokens per (item, choice).

    ``rows[r]`` holds at most ``max_seq_len + 1`` tokens whose last ``scored[r]`` are the
    continuation; the model reads all but the last and predicts all but the first.
    """

    names: list[str]
    """The tasks, in order."""
    rows: list[list[int]]
    scored: list[int]
    row_item: list[int]
    """The item (index into ``item_task``) of each row."""
    row_choice: list[int]
    """The choice (index into the item's choices) of each row."""
    item_task: list[int]
    """The task (index into ``names``) of each selected item."""
    gold: list[int]
    chars: list[list[int]]
    """Each item's choices' lengths in characters."""
    item_index: list[int]
    """Each selected item's index in its task's items (lm-eval's ``doc_id``)."""

    @property
    def num_items(self) -> int:
        return len(self.item_task)


def _subset(n: int, max_items: int) -> list[int]:
    """``max_items`` indices of ``n``, evenly spaced (all when ``max_items`` is 0 or >= n): the
    same subset at every validation and in ``plugtrain eval``, drawn from the whole file."""
    if not max_items or max_items >= n:
        return list(range(n))
    return [i * n // max_items for i in range(max_items)]


def encode_tasks(
    tasks: Sequence[Task], tokenizer: TextTokenizer, max_seq_len: int, max_items: int = 0
) -> EncodedTasks:
    """Tokenize at most ``max_items`` items of each task (0: all) for a model of
    ``max_seq_len`` positions. A continuation that does not fit the model is bad input."""
    encoded = EncodedTasks([t.name for t in tasks], [], [], [], [], [], [], [], [])
    for t, task in enumerate(tasks):
        for i in _subset(len(task.items), max_items):
            item = task.items[i]
            for j, choice in enumerate(item.choices):
                context_ids, continuation = encode_pair(
                    tokenizer, item.context, item.delimiter + choice
                )
                if not 1 <= len(continuation) <= max_seq_len:
                    raise DataError(
                        f"task file '{task.path}' item {i + 1}: a choice of {len(continuation)} "
                        f"tokens does not fit the model's {max_seq_len} positions: shorten it"
                    )
                encoded.rows.append((context_ids + continuation)[-(max_seq_len + 1) :])
                encoded.scored.append(len(continuation))
                encoded.row_item.append(encoded.num_items)
                encoded.row_choice.append(j)
            encoded.item_task.append(t)
            encoded.gold.append(item.gold)
            encoded.chars.append([len(c) for c in item.choices])
            encoded.item_index.append(i)
    return encoded


@dataclass(frozen=True)
class ItemScore:
    """One item's result, what lm-eval's ``--log_samples`` records of it."""

    task: int
    """The task (index into ``EncodedTasks.names``)."""
    index: int
    """The item's index in its task's items (lm-eval's ``doc_id``)."""
    choices: tuple[tuple[float, bool], ...]
    """Each choice's log-likelihood, and whether it is the greedy continuation (every token the
    model's most likely): lm-eval's ``(loglikelihood, is_greedy)``."""
    acc: bool
    """The highest log-likelihood is the gold choice's."""
    acc_norm: bool
    """The same per character."""


@dataclass(frozen=True)
class Score:
    """One task's result over every rank's items."""

    items: int
    correct: int
    """Items whose highest log-likelihood is the gold choice's."""
    correct_norm: int
    """The same with log-likelihoods divided by the choices' lengths in characters."""

    @property
    def acc(self) -> float:
        return self.correct / self.items

    @property
    def acc_norm(self) -> float:
        return self.correct_norm / self.items


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``correct / n`` (95% for ``z`` 1.96)."""
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def _batches(rows: Sequence[int], lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """``rows`` in batches of ``batch_size``, longest first, so that rows of similar length are
    padded together."""
    ordered = sorted(rows, key=lambda r: (-lengths[r], r))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


@torch.no_grad()
def _loglikelihoods(
    model: nn.Module,
    encoded: EncodedTasks,
    rows: Sequence[int],
    batches: Sequence[Sequence[int]],
    forwards: int,
    device: torch.device,
) -> torch.Tensor:
    """Each of ``rows``' continuation log-likelihood and count of tokens not the model's most
    likely (``[len(rows), 2]``, in that order, on the device); ``forwards`` forwards in all
    (one-token ones after the batches run out)."""
    position = {r: i for i, r in enumerate(rows)}
    out = torch.zeros(len(rows), 2, device=device)
    for n in range(forwards):
        if n >= len(batches):
            whole_logits(model, torch.zeros(1, 1, dtype=torch.long, device=device))
            continue
        batch = batches[n]
        width = max(len(encoded.rows[r]) for r in batch) - 1
        tokens = torch.zeros(len(batch), width + 1, dtype=torch.long)
        scored = torch.zeros(len(batch), width, dtype=torch.bool)
        for b, r in enumerate(batch):
            row = encoded.rows[r]
            tokens[b, : len(row)] = torch.tensor(row)
            scored[b, len(row) - 1 - encoded.scored[r] : len(row) - 1] = True
        tokens, scored = tokens.to(device), scored.to(device)
        # The log-softmax of the continuations' positions only: most positions are context.
        logprobs = F.log_softmax(whole_logits(model, tokens[:, :-1])[scored].float(), dim=-1)
        targets = tokens[:, 1:][scored]
        picked = logprobs.gather(-1, targets[:, None]).squeeze(-1)
        missed = (logprobs.argmax(dim=-1) != targets).float()  # lm-eval's is_greedy, per token
        where = torch.tensor([position[r] for r in batch], device=device)
        out.index_add_(
            0, where[:, None].expand_as(scored)[scored], torch.stack([picked, missed], 1)
        )
    return out


def _scoring(
    model: nn.Module,
    encoded: EncodedTasks,
    rows: Sequence[int],
    batch_size: int,
    forwards: int,
) -> torch.Tensor:
    """:func:`_loglikelihoods` of ``rows`` in eval mode, eagerly, resharded after."""
    lengths = [len(row) for row in encoded.rows]
    batches = _batches(rows, lengths, batch_size)
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    try:
        # Compiled blocks (the compile plugin) run eagerly: each padded width would be a new
        # graph.
        with torch.compiler.set_stance("force_eager"):
            return _loglikelihoods(model, encoded, rows, batches, forwards, device)
    finally:
        model.train(training)
        reshard(model)


def _scored_rows(
    model: nn.Module,
    encoded: EncodedTasks,
    batch_size: int,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Every row's continuation log-likelihood and whether it is greedy (1 or 0), ``[rows,
    2]`` on the device of every rank: this rank's rows scored, the others' summed in over
    ``group`` (each row is one rank's, so the sum is exact)."""
    mine = [r for r in range(len(encoded.rows)) if encoded.row_item[r] % world_size == rank]
    # Every rank knows every rank's rows: the number of forwards needs no collective.
    per_rank = [
        sum(1 for item in encoded.row_item if item % world_size == k) for k in range(world_size)
    ]
    forwards = max(math.ceil(n / batch_size) for n in per_rank)
    scored = _scoring(model, encoded, mine, batch_size, forwards)
    out = torch.zeros(len(encoded.rows), 2, device=scored.device)
    out[torch.tensor(mine, dtype=torch.long, device=scored.device)] = torch.stack(
        [scored[:, 0], (scored[:, 1] == 0).float()], dim=1
    )
    if world_size > 1:
        dist.all_reduce(out, group=group)
    return out


def _hits(encoded: EncodedTasks, lls: torch.Tensor) -> torch.Tensor:
    """Whether each item's highest log-likelihood, and highest per character, is its gold
    choice's: bool ``[items, 2]``, on ``lls``' device."""
    device = lls.device
    width = max(len(chars) for chars in encoded.chars)
    # One row per item, one column per choice; absent choices never win.
    table = torch.full((encoded.num_items, width), -math.inf, device=device)
    at_item = torch.tensor(encoded.row_item, device=device)
    table[at_item, torch.tensor(encoded.row_choice, device=device)] = lls
    chars = [c + [1] * (width - len(c)) for c in encoded.chars]
    normed = table / torch.tensor(chars, device=device)
    gold = torch.tensor(encoded.gold, device=device)
    return torch.stack([table.argmax(dim=1) == gold, normed.argmax(dim=1) == gold], dim=1)


def loglikelihoods(model: nn.Module, encoded: EncodedTasks, *, batch_size: int = 32) -> list[float]:
    """Each row's continuation log-likelihood (``encoded.row_item`` and ``row_choice`` say whose),
    on this process alone: the numbers :func:`score` compares."""
    return _scored_rows(model, encoded, batch_size, 0, 1, None)[:, 0].tolist()


def _score(
    model: nn.Module,
    encoded: EncodedTasks,
    batch_size: int,
    rank: int,
    world_size: int,
    group: dist.ProcessGroup | None,
) -> tuple[dict[str, Score], torch.Tensor, torch.Tensor]:
    """Each task's :class:`Score`, with every row's :func:`_scored_rows` and every item's
    :func:`_hits` they were counted from."""
    rows = _scored_rows(model, encoded, batch_size, rank, world_size, group)
    hits = _hits(encoded, rows[:, 0])
    device = rows.device
    counts = torch.zeros(len(encoded.names), 3, dtype=torch.long, device=device)
    every = torch.cat([torch.ones_like(hits[:, :1]), hits], dim=1).long()
    counts.index_add_(0, torch.tensor(encoded.item_task, device=device), every)
    scores = {
        name: Score(n, correct, correct_norm)
        for name, (n, correct, correct_norm) in zip(encoded.names, counts.tolist(), strict=True)
    }
    return scores, rows, hits


def score(
    model: nn.Module,
    encoded: EncodedTasks,
    *,
    batch_size: int = 32,
    rank: int = 0,
    world_size: int = 1,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Score]:
    """Score ``encoded`` with ``model`` on every rank (each with the same arguments): each
    task's :class:`Score`, the same on every rank and for any ``world_size``.

    ``model`` maps tokens ``[B, S]`` to logits ``[B, S, vocab]`` (a
    :class:`~plugtrain.model.llama.transformer.Transformer`, FSDP2-sharded, tensor-parallel or
    neither); it is put in eval mode for the passes and back, and resharded after them. The
    items are split over ``world_size`` ranks, this one ``rank``, and their log-likelihoods
    summed over ``group`` (None: every process), the group those ranks make: under tensor
    parallelism the data-parallel one, whose ranks each stand for a ``tp`` group. One
    all-reduce and one read of the counts on the host; no random number is drawn.
    """
    return _score(model, encoded, batch_size, rank, world_size, group)[0]


def score_items(
    model: nn.Module,
    encoded: EncodedTasks,
    *,
    batch_size: int = 32,
    rank: int = 0,
    world_size: int = 1,
    group: dist.ProcessGroup | None = None,
) -> tuple[dict[str, Score], list[ItemScore]]:
    """:func:`score`'s scores, and each item's :class:`ItemScore` (every rank's items, on
    every rank): the per-choice log-likelihoods ``plugtrain eval --log-samples`` writes."""
    scores, rows, hits = _score(model, encoded, batch_size, rank, world_size, group)
    per_item: list[list[tuple[float, bool]]] = [[] for _ in range(encoded.num_items)]
    for item, (ll, greedy) in zip(encoded.row_item, rows.tolist(), strict=True):
        per_item[item].append((ll, bool(greedy)))
    items = [
        ItemScore(task, index, tuple(choices), acc, acc_norm)
        for task, index, choices, (acc, acc_norm) in zip(
            encoded.item_task, encoded.item_index, per_item, hits.tolist(), strict=True
        )
    ]
    return scores, items
