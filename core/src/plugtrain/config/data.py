"""The [data] and [validation] sections: the documents, and how the validation loss is measured."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from plugtrain.errors import check_field

DATA_FORMATS = ("auto", "text", "chat")
"""``data.format``: ``auto`` reads a JSONL file whose first record holds ``messages`` as chat."""
CHAT_LOSSES = ("assistant", "all")
"""``data.chat_loss``: train on the assistant's tokens only, or on every token."""
CHAT_OVERLONG = ("truncate", "drop")
"""``data.chat_overlong``: what becomes of a conversation longer than the sequence."""


@dataclass
class DataConfig:
    """The training and validation documents."""

    train_path: str = "sample:train.jsonl"
    """JSONL file of training documents, one JSON object per line."""
    validation_path: str = "sample:validation.jsonl"
    """JSONL file of held-out documents for the validation loss."""
    text_field: str = "text"
    """The key of each JSON object that holds the document's text."""
    format: str = "auto"
    """``auto``: a JSONL file whose first record holds ``messages`` is chat data, any other is
    text; ``text`` or ``chat`` force either (docs/fine-tuning.md)."""
    chat_template: str = ""
    """A .jinja chat template for chat data; empty: the tokenizer folder's
    (``chat_template.jinja`` or tokenizer_config.json's), else plugtrain's default."""
    chat_loss: str = "assistant"
    """Chat data: ``assistant`` trains on the assistant's tokens only, ``all`` on every token."""
    chat_overlong: str = "truncate"
    """Chat data: a conversation longer than ``training.seq_len`` tokens is cut to it
    (``truncate``) or left out (``drop``); the run says how many."""
    shuffle: bool = True
    """Shuffle training samples (a new seeded permutation each epoch)."""
    reset_positions: bool | Literal["auto"] = "auto"
    """Restart the RoPE positions at 0 at each document of a packed sequence (Megatron's
    ``--reset-position-ids``), so that a document's tokens get the positions they would have
    alone. ``auto``: true with ``model.attention = "document"``, else false."""
    sources: list[dict] = field(default_factory=list)
    """A mixture that replaces ``train_path``: ``[{path=..., weight=...}, ...]``, each path a
    prepared folder or a data file, sampled in proportion to its weight (optional ``name``,
    default the path's last part, names its logged share ``data_share.<name>``)."""

    def __post_init__(self) -> None:
        for key, allowed in (
            ("format", DATA_FORMATS),
            ("chat_loss", CHAT_LOSSES),
            ("chat_overlong", CHAT_OVERLONG),
        ):
            value = getattr(self, key)
            check_field(value in allowed, key, f"is {value!r}: give one of {allowed}")
        for i, source in enumerate(self.sources):
            where = f"item {i} ({source!r})"
            check_field(
                isinstance(source.get("path"), str)
                and set(source) <= {"path", "weight", "name"}
                and isinstance(source.get("weight", 1.0), (int, float))
                and not isinstance(source.get("weight"), bool)
                and isinstance(source.get("name", ""), str),
                "sources",
                f'{where} must be {{path="...", weight=<number>, name="..." (optional)}}',
            )
            weight = source.get("weight", 1.0)
            check_field(weight > 0, "sources", f"{where} has weight {weight}: must be > 0")
        names = self.source_names()
        check_field(
            len(set(names)) == len(names),
            "sources",
            f"names {names} repeat: give each source a distinct name=",
        )

    def source_names(self) -> list[str]:
        """The name of each of ``sources``: its ``name``, or its path's last part."""
        return [s.get("name") or Path(s["path"]).name for s in self.sources]


@dataclass
class ValidationConfig:
    """How often and on how many batches the validation loss is measured."""

    interval: int = 50
    """Evaluate the validation loss every this many steps and at the end; 0 disables it."""
    steps: int = 4
    """Validation batches (of ``training.batch_size`` sequences) per evaluation."""

    def __post_init__(self) -> None:
        check_field(self.interval >= 0, "interval", f"must be >= 0, got {self.interval}")
        check_field(self.steps >= 1, "steps", f"must be >= 1, got {self.steps}")
