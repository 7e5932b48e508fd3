"""Llama's decoder split into pipeline stages, for llama and moe (``ModelSpec.pipeline_split``).

A stage is a copy of the model that keeps its share of the blocks under their own names
(``Transformer.layers`` is keyed by block index, so a stage's parameter names, checkpoint keys
and plans by name are the whole model's), the embedding on the first stage, the final norm and
the output on the last, and None for every module it does not hold. Its forward takes what the
stage before returns (the tokens on the first stage, hidden states ``[B, S, dim]`` on the
others) and returns hidden states, or on the last stage what the whole model returns (the
logits, or ``head(hidden, project)``). Every stage is given the same keyword arguments
(``documents``, ``positions``) and builds its own attention mask and RoPE rotations from them,
so a schedule that splits them per microbatch hands each stage the microbatch's own.

The stages hold as many blocks each: the layers must divide into the stages, else a one-line
refusal. torchtitan instead counts the embedding and the output as a layer each and spreads the
remainder; an even split keeps every stage's work the same, which a schedule's bubble assumes,
and leaves the choice of a divisor to the user.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from plugtrain.errors import ConfigError
from plugtrain.model.llama.transformer import Transformer

__all__ = ["pipeline_split", "stage_layers"]


def stage_layers(n_layers: int, stages: int, stage: int) -> range:
    """The blocks of stage ``stage`` of ``stages`` of an ``n_layers`` model; a one-line
    ``ConfigError`` where the layers do not divide into the stages."""
    if stages < 1:
        raise ConfigError(f"the number of pipeline stages must be >= 1, got {stages}")
    if n_layers % stages:
        raise ConfigError(
            f"model.n_layers = {n_layers} does not divide into {stages} pipeline stages: "
            f"choose a number of stages that divides {n_layers}"
        )
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is not one of the {stages} stages 0 .. {stages - 1}")
    per = n_layers // stages
    return range(stage * per, (stage + 1) * per)


def pipeline_split(model: Transformer, stages: int, indices: Sequence[int]) -> list[Transformer]:
    """Stages ``indices`` of ``model`` (built, unsharded; on the meta device in training) cut
    into ``stages``, one module each, in the order of ``indices`` (a rank of an interleaved
    schedule holds several). ``model`` itself is left whole.

    Refused in one line: layers that do not divide into the stages, and tied embeddings over
    several stages (the first stage's embedding would be the last stage's output matrix).
    """
    args = model.args
    if stages > 1 and model.output is None:
        raise ConfigError(
            f"a model with tied embeddings cannot be split into {stages} pipeline stages (the "
            "first stage's embedding is the last stage's output): set model.tie_embeddings = "
            "false"
        )
    parts = []
    for index in indices:
        keep = stage_layers(args.n_layers, stages, index)
        stage = copy.deepcopy(model)
        for name in [name for name in stage.layers if int(name) not in keep]:
            del stage.layers[name]
        if index > 0:
            stage.tok_embeddings = None
        if index < stages - 1:
            stage.norm = None
            stage.output = None
        parts.append(stage)
    return parts
