"""Global random generators (torch CPU and CUDA, Python, NumPy): seeding, and states as tensors.

Each rank seeds them at start-up; checkpoints save and restore their states.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def seed_generators(seed: int, rank: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch's (CPU and every CUDA device)
    for ``rank`` of a run whose ``training.seed`` is ``seed``.

    Each rank gets its own stream, hashed from the pair ``(seed, rank)`` by NumPy's
    ``SeedSequence``: unlike ``seed + rank``, seed 1 on rank 0 and seed 0 on rank 1 do not share
    one, and nearby seeds give unrelated streams. The three generators get different words of
    the hash. A resumed run then replaces these states with the checkpoint's, so that it
    continues exactly; weight init and the data order use generators of their own.
    """
    words = np.random.SeedSequence([seed, rank]).generate_state(3, dtype=np.uint64)
    random.seed(int(words[0]))
    np.random.seed(int(words[1] >> np.uint64(32)))  # the legacy global generator takes 32 bits
    torch.manual_seed(int(words[2] >> np.uint64(1)))  # torch takes an int64: keep 63 bits


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random generators (torch CPU and CUDA, Python, NumPy) as tensors."""
    version, words, gauss = random.getstate()
    _, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {
            "version": version,
            "words": torch.tensor(words, dtype=torch.int64),
            "has_gauss": gauss is not None,
            "gauss": gauss or 0.0,
        },
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(cached_gaussian),
        },
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    """Restore what :func:`rng_state` returned (after :func:`from_tensors`)."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate(
        (py["version"], tuple(py["words"].tolist()), py["gauss"] if py["has_gauss"] else None)
    )
    npy = state["numpy"]
    np.random.set_state(
        ("MT19937", npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
         npy["gauss"])
    )  # fmt: skip
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
