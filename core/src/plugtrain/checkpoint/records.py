"""The chat template saved with each checkpoint, beside its config, and read back from it.

A run on chat data saves, in every checkpoint folder, the template its data was rendered with
(:data:`~plugtrain.checkpoint.layout.CHAT_TEMPLATE`, the text as is) and its record
(:data:`~plugtrain.checkpoint.layout.CHAT_TEMPLATE_RECORD`: its sha256, where the run read it,
its special tokens). ``export-hf`` and ``generate --chat`` read them through the checkpoint's
store, so a dump folder on an object store serves as a local one. A text run saves neither,
and nor did runs before the template was recorded: their readers get None.
"""

from __future__ import annotations

import json

from plugtrain.checkpoint.layout import CHAT_TEMPLATE, CHAT_TEMPLATE_RECORD
from plugtrain.checkpoint.storage import CheckpointStorage
from plugtrain.data import ChatTemplate
from plugtrain.errors import CheckpointError, UserError, one_line

__all__ = ["chat_template_files", "read_chat_template"]


def chat_template_files(template: ChatTemplate | None) -> dict[str, bytes]:
    """The files that record ``template`` in a checkpoint folder, by name (none for None)."""
    if template is None:
        return {}
    record = json.dumps(template.record(), indent=2) + "\n"
    return {CHAT_TEMPLATE: template.source.encode(), CHAT_TEMPLATE_RECORD: record.encode()}


def read_chat_template(storage: CheckpointStorage, step: int) -> ChatTemplate | None:
    """The chat template the complete checkpoint of ``step`` records, None if it records none;
    a one-line :class:`CheckpointError` if the record cannot be read or does not match."""
    try:
        raw = storage.read_file(step, CHAT_TEMPLATE_RECORD)
    except FileNotFoundError:
        return None  # a text run's, or one saved before the template was recorded
    except OSError as e:
        raise _damaged(storage, step, e) from e
    try:
        source = storage.read_file(step, CHAT_TEMPLATE).decode()
        where = f"{storage.where(step)}/{CHAT_TEMPLATE}"
        return ChatTemplate.from_record(source, json.loads(raw), where)
    except (OSError, ValueError, KeyError, TypeError, UserError) as e:
        raise _damaged(storage, step, e) from e


def _damaged(storage: CheckpointStorage, step: int, error: BaseException) -> CheckpointError:
    return CheckpointError(
        f"checkpoint '{storage.where(step)}' is damaged: its chat template cannot be read "
        f"({one_line(error)}); use another step-N folder of the run"
    )
