"""Write the shipped preference sample, derived from the chat sample, for DPO.

Each pair comes from one conversation of ``chat_train.jsonl`` (``chat_validation.jsonl`` for
the validation split): the prompt is its last question (after its system prompt, if it has
one; earlier turns are left out to keep pairs short), the chosen completion is its last reply
(right: the question determines it) and the rejected completion is the last reply of the next
conversation of the file (an answer to another question: wrong). One pair in four is written
in TRL's implicit-prompt form (the prompt repeated in both sides) so that both forms ship.
Deterministic, with no other source:

    python scripts/build_preference_sample.py  # writes sample/preference_*.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[1] / "core" / "src" / "plugtrain" / "sample"
SPLITS = {"train": "chat_train.jsonl", "validation": "chat_validation.jsonl"}


def pairs(conversations: list[list[dict[str, str]]]) -> list[dict]:
    """One preference record per conversation (see the module doc)."""
    records = []
    for i, messages in enumerate(conversations):
        system = [m for m in messages[:1] if m["role"] == "system"]
        prompt, chosen = system + messages[-2:-1], messages[-1:]
        rejected = conversations[(i + 1) % len(conversations)][-1:]
        if rejected == chosen:  # two conversations that end alike: take the one after
            rejected = conversations[(i + 2) % len(conversations)][-1:]
        if i % 4 == 3:
            records.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
        else:
            records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SAMPLE)
    out = parser.parse_args().out
    for split, source in SPLITS.items():
        lines = (SAMPLE / source).read_text().splitlines()
        conversations = [json.loads(line)["messages"] for line in lines]
        text = "".join(json.dumps(r) + "\n" for r in pairs(conversations))
        (out / f"preference_{split}.jsonl").write_text(text)


if __name__ == "__main__":
    main()
