"""Write the shipped chat sample: small conversations whose answers a tiny model can learn.

Each conversation has one to three user questions of four kinds (a sum, a word reversed, a
word's letters counted, a word in capitals), each answered by the assistant in one sentence
that the question determines, and a system prompt one time in three. Everything is drawn from
``random.Random(SEED)`` over the word list below, so each run writes the same bytes:

    python scripts/build_chat_sample.py  # writes core/src/plugtrain/sample/chat_*.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 35
TRAIN, VALIDATION = 600, 60
"""Conversations in chat_train.jsonl and chat_validation.jsonl."""
WORDS = (
    "tempest",
    "storm",
    "island",
    "magic",
    "spirit",
    "sonnet",
    "crown",
    "dagger",
    "ghost",
    "castle",
    "forest",
    "letter",
    "sword",
    "river",
    "candle",
    "garden",
    "winter",
    "summer",
    "harbour",
    "lantern",
    "mirror",
    "feather",
    "quill",
    "stage",
    "actor",
    "curtain",
    "thunder",
    "moon",
    "violet",
    "willow",
    "raven",
    "banquet",
)
SYSTEM = "You are a careful assistant. Answer in one sentence."
OUT = Path(__file__).resolve().parents[1] / "core" / "src" / "plugtrain" / "sample"


def exchange(rng: random.Random) -> tuple[str, str]:
    """One question and its answer."""
    kind = rng.randrange(4)
    word = rng.choice(WORDS)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        return f"Reverse the word '{word}'.", f"'{word}' reversed is '{word[::-1]}'."
    if kind == 2:
        return f"How many letters are in '{word}'?", f"'{word}' has {len(word)} letters."
    return f"Write '{word}' in capitals.", f"In capitals, '{word}' is '{word.upper()}'."


def conversation(rng: random.Random) -> dict[str, list[dict[str, str]]]:
    """A conversation record: ``{"messages": [...]}``."""
    messages = [{"role": "system", "content": SYSTEM}] if rng.randrange(3) == 0 else []
    for _ in range(rng.randint(1, 3)):
        question, answer = exchange(rng)
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    return {"messages": messages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="the folder to write into")
    args = parser.parse_args()
    rng = random.Random(SEED)
    for name, count in (("chat_train.jsonl", TRAIN), ("chat_validation.jsonl", VALIDATION)):
        lines = [json.dumps(conversation(rng)) + "\n" for _ in range(count)]
        (args.out / name).write_text("".join(lines))


if __name__ == "__main__":
    main()
