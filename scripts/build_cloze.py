"""Build the shipped next-line cloze task from the sample's held-out plays (validation.jsonl).

    python scripts/build_cloze.py    # writes core/src/plugtrain/sample/cloze.jsonl

Deterministic: the same input gives the same bytes (the random choices come from a generator
seeded per item). For each play of the validation split, the candidate questions are the lines
after its first act heading (past the list of characters) that have 4 lines before them in the
same speech (no blank line, speaker name or stage direction between); ITEMS_PER_PLAY of them,
evenly spaced through the play, become items: the context is those 4 lines, the choices are the
true next line and 3 other spoken lines of the same play, drawn at random among those whose
length is within LENGTH_SLACK characters of the true line's (distinct, none equal to it), in a
random order. Matching lengths keeps a scorer that merely prefers short (or long) choices at
chance. The delimiter between context and choice is a newline, as in the text.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[1] / "core" / "src" / "plugtrain" / "sample"
CONTEXT_LINES = 4
CHOICES = 4
ITEMS_PER_PLAY = 200
LENGTH_SLACK = 4
MIN_CHARS = 12
"""Spoken lines shorter than this (``Ay.``, ``Sir?``) are neither questions nor distractors."""
SPEAKER = re.compile(r"^[A-Z][A-Z' ]+\.$")


def spoken(line: str) -> bool:
    """Whether ``line`` is spoken text: not blank, a speaker's name or a stage direction."""
    text = line.strip()
    return bool(text) and not SPEAKER.match(text) and not text.startswith(("[", "ACT ", "SCENE"))


def items_of(title: str, text: str) -> list[dict]:
    lines = [line.rstrip() for line in text.splitlines()]
    pool = sorted({line for line in lines if spoken(line) and len(line) >= MIN_CHARS})
    first = next(i for i, line in enumerate(lines) if line.upper().startswith("ACT "))
    candidates = [
        i
        for i in range(first + CONTEXT_LINES, len(lines))
        if len(lines[i]) >= MIN_CHARS and all(spoken(x) for x in lines[i - CONTEXT_LINES : i + 1])
    ]
    chosen = [candidates[k * len(candidates) // ITEMS_PER_PLAY] for k in range(ITEMS_PER_PLAY)]
    items = []
    for i in chosen:
        rng = random.Random(f"{title}:{i}")
        true = lines[i]
        near = [x for x in pool if x != true and abs(len(x) - len(true)) <= LENGTH_SLACK]
        choices = [true, *rng.sample(near, CHOICES - 1)]
        rng.shuffle(choices)
        items.append(
            {
                "context": "\n".join(lines[i - CONTEXT_LINES : i]),
                "choices": choices,
                "gold": choices.index(true),
                "delimiter": "\n",
            }
        )
    return items


def main() -> None:
    items = []
    with (SAMPLE / "validation.jsonl").open(encoding="utf-8") as f:
        for line in f:
            play = json.loads(line)
            items += items_of(play["title"], play["text"])
    out = SAMPLE / "cloze.jsonl"
    out.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items))
    print(f"wrote {out}: {len(items)} items")


if __name__ == "__main__":
    main()
