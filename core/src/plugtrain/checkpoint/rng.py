"""Random generator states (torch CPU and CUDA, Python, NumPy) as tensors, for checkpoints."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


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
