"""Preference data: pairs of a chosen and a rejected completion of one prompt, for DPO.

A record is TRL's conversational format, ``{"prompt": [messages], "chosen": [messages],
"rejected": [messages]}``, or its implicit-prompt form ``{"chosen": [...], "rejected": [...]}``
whose common leading messages are the prompt. Each side is rendered as chat data is
(:func:`plugtrain.data.chat.encode_conversation`, the same template and tokens), the prompt
followed by its completion; the completion's assistant tokens are its mask, the prompt's own
assistant turns (a multi-turn prompt) count for neither side.

A pair is two adjacent documents, chosen then rejected, and pairs are packed into *bins* of
``seq_len + 1`` tokens, one training sample each (:class:`plugtrain.data.PackedDataset` cuts
the stream into samples of that width): a pair that does not fit in what is left of a bin
starts the next one, and the rest of the bin is a padding document that counts for nothing.
Every chunk of pairs encoded at once fills whole bins, so samples start at a pair wherever the
chunk lands in the stream, and in every sample's documents (numbered from 0 in each row) the
chosen side of a pair is an even number and its rejected side the next one. With document
masking no sequence attends to another. A pair longer than a bin is cut (each side keeps its
share of the bin, the longer side cut first) or dropped, as ``data.chat_overlong`` says; one
whose completion a cut leaves empty is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from plugtrain.data.chat import ChatTemplate, check_messages, encode_conversation
from plugtrain.data.tokenizer import Tokenizer
from plugtrain.errors import DataError

FIX = 'give {"prompt": [messages], "chosen": [messages], "rejected": [messages]}'
"""How a preference record is written, for error messages."""


def is_preference(record: Any) -> bool:
    """Whether ``record`` is meant as a preference pair: it names a chosen or a rejected side."""
    return isinstance(record, dict) and ("chosen" in record or "rejected" in record)


@dataclass(frozen=True)
class PreferencePair:
    """A checked pair: the prompt's messages and each completion's, and ``where`` it was read
    (``path:line``), which errors while it is encoded name."""

    prompt: list[dict[str, str]]
    chosen: list[dict[str, str]]
    rejected: list[dict[str, str]]
    where: str


def check_preference(record: Any, where: str) -> PreferencePair:
    """``record`` as a :class:`PreferencePair`; a one-line :class:`DataError` naming ``where``
    for a missing side, an empty completion, identical sides or a prompt that does not end with
    the user's (or a tool's) turn."""
    for side in ("chosen", "rejected"):
        if not isinstance(record, dict) or side not in record:
            raise DataError(f"{where} has no {side!r} (preference data): {FIX}")
    chosen = check_messages(record["chosen"], where, "chosen", FIX)
    rejected = check_messages(record["rejected"], where, "rejected", FIX)
    if "prompt" in record:
        prompt = check_messages(record["prompt"], where, "prompt", FIX)
    else:  # implicit prompt: the messages both sides share
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not prompt:
            raise DataError(f"{where}: 'chosen' and 'rejected' share no prompt message: {FIX}")
    if prompt[-1]["role"] not in ("user", "tool"):
        raise DataError(
            f"{where}: the prompt ends with a {prompt[-1]['role']!r} message: it must end with "
            "the user's turn, which the completions answer"
        )
    for side, messages in (("chosen", chosen), ("rejected", rejected)):
        if not messages or not any(m["content"] for m in messages if m["role"] == "assistant"):
            raise DataError(f"{where}: the {side!r} completion is empty: give the reply")
        if messages[0]["role"] != "assistant":
            raise DataError(
                f"{where}: the {side!r} completion starts with a {messages[0]['role']!r} "
                "message: it must start with the assistant's reply"
            )
    if chosen == rejected:
        raise DataError(f"{where}: 'chosen' equals 'rejected': a pair must differ; fix the line")
    return PreferencePair(prompt, chosen, rejected, where)


@dataclass(frozen=True)
class PairPacker:
    """Encodes and packs pairs into bins of ``width`` tokens (``seq_len + 1``), cutting or
    dropping the long ones as ``overlong`` says (see the module doc)."""

    template: ChatTemplate
    width: int
    overlong: str = "truncate"

    def encode(
        self, pairs: list[PreferencePair], tokenizer: Tokenizer
    ) -> tuple[list[list[int]], list[np.ndarray], int, int, list[int]]:
        """The documents of the packed bins (each side of each kept pair, and the padding) and
        their masks, how many pairs were cut and dropped, and every pair's length uncut."""
        docs: list[list[int]] = []
        masks: list[np.ndarray] = []
        truncated = dropped = filled = 0
        lengths = []
        for pair in pairs:
            first = len(pair.prompt)
            try:
                sides = [
                    encode_conversation(pair.prompt + side, self.template, tokenizer, first)
                    for side in (pair.chosen, pair.rejected)
                ]
            except DataError as e:
                raise DataError(f"{pair.where}: {e}") from e
            (c_ids, c_mask), (r_ids, r_mask) = sides
            lengths.append(len(c_ids) + len(r_ids))
            if lengths[-1] > self.width:
                if self.overlong == "drop":
                    dropped += 1
                    continue
                keep_c = min(len(c_ids), max(self.width - len(r_ids), self.width // 2))
                keep_r = self.width - keep_c
                c_ids, c_mask, r_ids, r_mask = (
                    c_ids[:keep_c], c_mask[:keep_c], r_ids[:keep_r], r_mask[:keep_r]
                )  # fmt: skip
                if not (c_mask.any() and r_mask.any()):  # a cut left a completion empty
                    dropped += 1
                    continue
                truncated += 1
            if filled + len(c_ids) + len(r_ids) > self.width:
                filled = self._pad(docs, masks, filled, tokenizer)
            docs += [c_ids, r_ids]
            masks += [c_mask, r_mask]
            filled += len(c_ids) + len(r_ids)
        self._pad(docs, masks, filled, tokenizer)
        return docs, masks, truncated, dropped, lengths

    def _pad(
        self, docs: list[list[int]], masks: list[np.ndarray], filled: int, tokenizer: Tokenizer
    ) -> int:
        """Close the bin ``filled`` tokens into with a padding document (none if full or
        empty); the next bin's fill, 0."""
        if 0 < filled < self.width:
            docs.append([tokenizer.eos_id] * (self.width - filled))
            masks.append(np.zeros(self.width - filled, dtype=np.uint8))
        return 0
