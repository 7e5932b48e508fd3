"""Fixtures of the grad_clip tests (the test kit, plugtrain.testing, gives the rest)."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def _clip_args(max_norm: float, *extra: str) -> list[str]:
    return ["--plugins.enabled", "grad_clip", "--grad_clip.max_norm", str(max_norm), *extra]


@pytest.fixture(scope="module")
def clip_args() -> Callable[..., list[str]]:
    """``clip_args(max_norm, *extra)``: arguments that enable grad_clip with ``max_norm``."""
    return _clip_args
