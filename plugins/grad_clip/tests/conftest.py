"""Puts the core's test helpers (``tests/runs.py``, ``tests/distributed.py``...) and this
folder's ``support/`` on ``sys.path``.

The per-rank functions live in ``support/grad_clip_workers.py``, a module importable by
name, because ``run_distributed`` pickles them into spawned processes. ``support/`` holds no
``conftest.py``, so it cannot shadow the core tests' ``from conftest import ...``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
for path in (REPO / "tests", Path(__file__).parent / "support"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
