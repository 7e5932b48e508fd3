"""Each item's scores as lm-evaluation-harness's ``--log_samples`` records them.

``plugtrain eval --log-samples FILE`` writes one JSON object per item, in the shape of the
records lm-eval 0.4's ``simple_evaluate(log_samples=True)`` returns for a ``multiple_choice``
task: ``doc_id`` (the item's index in its task file), ``doc``, ``target`` (the gold index),
``arguments`` (each choice's request: the context, and the delimiter then the choice),
``resps`` (each choice's one response) and ``filtered_resps`` (each choice's), both
``[loglikelihood, is_greedy]``, ``filter`` (``"none"``), ``metrics``, the sha256 of the doc,
of the first request's context and of the target as lm-eval hashes them, and ``acc`` and
``acc_norm`` (1.0 or 0.0); plus ``task``, the task's name, as one file holds every task.
Numbers and booleans are JSON's own (lm-eval's samples file writes them as strings).

``doc`` is the item as plugtrain reads it, ``context``, ``choices``, ``gold`` and ``delimiter``
(a HellaSwag line after lm-eval's preprocessing): for a task file of those four keys in that
order, lm-eval's own ``doc``, so its ``doc_hash`` too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from plugtrain.evaluation.multiple_choice import ItemScore, Task

__all__ = ["sample_records"]


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def sample_records(tasks: Sequence[Task], items: Sequence[ItemScore]) -> list[dict[str, Any]]:
    """The record of each of ``items`` (scored on ``tasks``, in the order they were encoded)."""
    records = []
    for scored in items:
        task = tasks[scored.task]
        item = task.items[scored.index]
        doc = {
            "context": item.context,
            "choices": list(item.choices),
            "gold": item.gold,
            "delimiter": item.delimiter,
        }
        arguments = [[item.context, item.delimiter + choice] for choice in item.choices]
        responses = [[ll, greedy] for ll, greedy in scored.choices]
        records.append(
            {
                "task": task.name,
                "doc_id": scored.index,
                "doc": doc,
                "target": item.gold,
                "arguments": arguments,
                "resps": [[response] for response in responses],
                "filtered_resps": responses,
                "filter": "none",
                "metrics": ["acc", "acc_norm"],
                "doc_hash": _sha256(json.dumps(doc, indent=2, ensure_ascii=False)),
                "prompt_hash": _sha256(item.context),
                "target_hash": _sha256(str(item.gold)),
                "acc": float(scored.acc),
                "acc_norm": float(scored.acc_norm),
            }
        )
    return records
