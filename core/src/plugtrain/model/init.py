"""Initialising a model's parameters from its init plan, the same whatever the sharding.

A family's model lists every parameter with how to fill it (its init plan:
``ModelSpec.init_plan``); :func:`initialize` draws each parameter's full tensor on the CPU from
its own generator and keeps each rank's shard of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["Fill", "fill_parameter", "init_normal", "init_ones", "init_trunc_normal", "initialize"]

Fill = Callable[[torch.Tensor, torch.Generator], torch.Tensor]
"""Fills a float32 CPU tensor in place from a generator and returns it (see init_weights)."""


def init_ones(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill with ones (norm scales); draws nothing."""
    return t.fill_(1.0)


def init_normal(std: float) -> Fill:
    """Fill with N(0, std^2)."""
    return lambda t, generator: t.normal_(0.0, std, generator=generator)


def init_trunc_normal(std: float) -> Fill:
    """Fill with N(0, std^2) truncated at +-3 std (drawn from the truncated law, not clipped)."""
    return lambda t, generator: nn.init.trunc_normal_(
        t, 0.0, std, -3 * std, 3 * std, generator=generator
    )


@torch.no_grad()
def initialize(
    model: nn.Module,
    plan: list[tuple[nn.Parameter, Fill]],
    seed: int,
    stored: Mapping[int, Callable[[torch.Tensor], None]] | None = None,
) -> None:
    """Fill every parameter of ``model`` as ``plan`` says, deterministically from ``seed``;
    those in ``stored`` (by ``id``) are given their full tensor to store as they hold it
    (``model.conversion``).

    Gives bit-identical full parameters whether they are plain tensors or FSDP2-sharded
    DTensors (any mesh, any world size), and whether the model was built on the CPU or on
    the meta device and then ``to_empty``'d.

    Each parameter's FULL tensor is drawn on the CPU from its own ``torch.Generator``
    (seeded from ``seed`` and the parameter's position in ``plan``), then every rank
    keeps its shard. Calling ``nn.init`` on the DTensors directly would not do: DTensor
    random ops on the CPU draw each shard from the local generator, so the full weights
    would depend on the world size, and a 1-process run and an N-process run would start
    from different weights. The cost is that every rank draws every full tensor once.
    """
    planned = {id(param) for param, _ in plan}
    missing = [name for name, p in model.named_parameters() if id(p) not in planned]
    if missing or len(planned) != len(plan):
        raise RuntimeError(f"init_plan does not cover each parameter exactly once: {missing}")
    stored = stored or {}
    for index, (param, fill) in enumerate(plan):
        fill_parameter(param, fill, seed, index, stored.get(id(param)))


@torch.no_grad()
def fill_parameter(
    param: nn.Parameter,
    fill: Fill,
    seed: int,
    index: int,
    store: Callable[[torch.Tensor], None] | None = None,
) -> None:
    """Fill ``param`` (plain or a DTensor) as :func:`initialize` fills the parameter at
    ``index`` of its plan: its full tensor, drawn on the CPU, then this rank's shard; or
    ``store(full)`` where the parameter is held in another form."""
    if param.is_meta:
        raise RuntimeError(
            "init_weights called on meta parameters; materialise them first with "
            "model.to_empty(device=...)"
        )
    generator = torch.Generator().manual_seed(_param_seed(seed, index))
    full = fill(torch.empty(param.shape, dtype=torch.float32), generator)
    if store is not None:
        store(full)
    elif isinstance(param, DTensor):
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)


def _param_seed(seed: int, index: int) -> int:
    """A 63-bit generator seed for parameter ``index`` of run ``seed``.

    Hashed rather than ``seed + index`` so that seed s and seed s+1 share no tensor streams.
    """
    digest = hashlib.sha256(f"plugtrain-init:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
