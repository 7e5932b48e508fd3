"""Puts the core's test helpers (``tests/runs.py``, ``tests/distributed.py``) and this folder's
``support/`` on ``sys.path``.

``support/grad_scaler_testing.py`` must be importable by name, because
``run_distributed`` pickles its per-rank functions into spawned processes. ``support/`` holds
no ``conftest.py``, so it cannot shadow the core tests' ``from conftest import ...``.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (HERE.parents[2] / "tests", HERE / "support"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
