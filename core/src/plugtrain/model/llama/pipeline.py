"""Llama's decoder split into pipeline stages, for llama and moe (``ModelSpec.pipeline_split``).

A rank of a pipeline holds one or more stages (an interleaved schedule's several). The split
prunes the model in place into the rank's *part*: the blocks of its stages under their own
names (``Transformer.layers`` is keyed by block index, so the part's parameter names,
checkpoint keys and plans by name are the whole model's), the embedding if it holds the first
stage, the final norm and the output if it holds the last, and None for every module it does
not hold. Each stage is then a view of the part: a module of the model's class that shares the
part's modules, holds its own blocks only, and is what a schedule runs. A stage's forward takes
what the stage before returns (the tokens on the first stage, hidden states ``[B, S, dim]``
on the others) and returns hidden states, or on the last stage what the whole model returns
(the logits, or ``head(hidden, project)``). Every stage is given the same keyword arguments
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

from torch import nn

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
    """Prune ``model`` (built, unsharded; on the meta device in training) in place into the
    part of a rank holding stages ``indices`` of ``stages``, and return those stages, in the
    order of ``indices``: views that share the part's modules (see the module doc). With every
    index, the model is left whole.

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
    blocks = {index: stage_layers(args.n_layers, stages, index) for index in indices}
    held = {str(i) for keep in blocks.values() for i in keep}
    for name in [name for name in model.layers if name not in held]:
        del model.layers[name]
    if 0 not in blocks:
        model.tok_embeddings = None
    if stages - 1 not in blocks:
        model.norm = model.output = None
    return [_stage(model, blocks[index], index == 0, index == stages - 1) for index in indices]


def _stage(part: Transformer, blocks: range, first: bool, last: bool) -> Transformer:
    """A stage of ``part``: a copy of its own attributes that shares its modules and tensors,
    with ``blocks``, the embedding if ``first``, the norm and output if ``last``."""
    # Every module and tensor the part holds is given as its own copy: shared, not copied.
    shared = [*part.modules(), *part.parameters(), *part.buffers()]
    stage = copy.deepcopy(part, memo={id(item): item for item in shared if item is not part})
    stage.layers = nn.ModuleDict({str(i): part.layers[str(i)] for i in blocks})
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = stage.output = None
    return stage
