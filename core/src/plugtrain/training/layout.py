"""How a run lays its model out over the ranks: ``model.build_model``'s parallel arguments.

Tensor parallelism's mesh, expert parallelism's meshes, the pipeline's stages of this rank
(``training.pipeline.pipeline_placement``) and context parallelism's group and method, each
None where the run does not use it; what the model cannot be split by is refused here, in one
line, before it is built.
"""

from __future__ import annotations

from typing import Any

from plugtrain.config import JobConfig
from plugtrain.distributed import ParallelDims
from plugtrain.errors import ConfigError
from plugtrain.model import ModelSpec
from plugtrain.training.pipeline import pipeline_placement


def model_layout(config: JobConfig, dims: ParallelDims, spec: ModelSpec) -> dict[str, Any]:
    """``build_model``'s keyword arguments for the layout of ``dims``: ``tp_mesh``,
    ``ep_meshes``, ``pipeline`` and ``context``."""
    return {
        "tp_mesh": dims.get_mesh("tp") if dims.tp_enabled else None,
        "ep_meshes": dims.expert_meshes(),
        "pipeline": pipeline_placement(config, dims, spec),
        "context": context_parallel(config, dims, spec),
    }


def context_parallel(
    config: JobConfig, dims: ParallelDims, spec: ModelSpec
) -> tuple[Any, str] | None:
    """The ``cp`` group and ``cp_method`` under context parallelism (checked by
    :func:`check_context_parallel`), else None."""
    if not dims.cp_enabled:
        return None
    check_context_parallel(config, dims, spec)
    return dims.get_mesh("cp").get_group(), config.parallelism.cp_method


def check_context_parallel(config: JobConfig, dims: ParallelDims, spec: ModelSpec) -> None:
    """Refuse in one line what context parallelism cannot split: a ``seq_len`` that does not
    divide into ``2 x cp`` chunks, key/value heads that Ulysses cannot split, a family that is
    not Llama's."""
    cp, method, seq_len = dims.cp, config.parallelism.cp_method, config.training.seq_len
    if cp == 1:
        return
    if spec.name != "llama":
        raise ConfigError(
            f"model.family = '{spec.name}' does not run under context parallelism yet "
            f"(parallelism.cp = {cp}): set parallelism.cp = 1"
        )
    if seq_len % (2 * cp):
        raise ConfigError(
            f"training.seq_len = {seq_len} does not divide into 2 x cp = {2 * cp} chunks (each "
            f"rank holds one from each end of a row): choose a seq_len that {2 * cp} divides"
        )
    args = config.model.model_args(None, seq_len)
    if method == "ulysses" and args.n_kv_heads % cp:
        raise ConfigError(
            f"parallelism.cp_method = 'ulysses' splits the heads over cp = {cp} ranks, but "
            f"model.n_kv_heads = {args.n_kv_heads} does not divide by {cp}: use cp_method = "
            "'allgather', or a cp that divides the key/value heads"
        )
