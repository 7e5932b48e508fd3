"""Shared fixtures: small, fast runs of the real trainer on the shipped sample."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the helper modules below (distributed, runs)


@pytest.fixture
def repo() -> Path:
    return REPO


def read_metrics(dump_folder: Path) -> list[dict]:
    """The JSONL records a run wrote, in order."""
    return [json.loads(line) for line in (dump_folder / "metrics.jsonl").read_text().splitlines()]
