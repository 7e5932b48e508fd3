"""The blocks keyed by index, and the families' pipeline stages: the names a stage keeps, and
stages run one after another giving the whole model's logits bitwise."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plugtrain.data.pipeline import document_positions
from plugtrain.errors import ConfigError
from plugtrain.model import LLAMA, MOE

TINY = LLAMA.flavors["tiny"]
BLOCK = [
    "attention_norm.weight",
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "attention.wo.weight",
    "ffn_norm.weight",
    "feed_forward.w1.weight",
    "feed_forward.w2.weight",
    "feed_forward.w3.weight",
]
# Four blocks, so that 2 and 4 stages divide them; the moe family with a dense block (0) and a
# shared expert, so that each kind of block is split.
SHAPES = {
    "llama": dataclasses.replace(TINY, n_layers=4, attention="document"),
    "moe": dataclasses.replace(
        MOE.flavors["debug_moe"],
        n_layers=4,
        dim=32,
        vocab_size=256,
        num_experts=4,
        moe_ffn_dim=16,
        mlp_only_layers=(0,),
        ffn_dim=48,
        shared_ffn_dim=16,
        attention="document",
    ),
}
SPECS = {"llama": LLAMA, "moe": MOE}


def model_of(family: str) -> torch.nn.Module:
    model = SPECS[family].build(SHAPES[family])
    model.init_weights(0)
    return model


def test_the_blocks_keep_the_module_list_names_and_order():
    """State dict (a checkpoint's ``model.`` keys, the model's Stateful ``state_dict``) and init
    plan: ``layers.N.`` as with the ``nn.ModuleList`` the blocks were before, in its order."""
    model = LLAMA.build(TINY)
    names = [
        "tok_embeddings.weight",
        *(f"layers.{i}.{name}" for i in range(TINY.n_layers) for name in BLOCK),
        "norm.weight",
        "output.weight",
    ]
    assert list(model.state_dict()) == names
    # The init plan's order (each parameter's random stream is its index in it): w3 before w2.
    plan_block = [*BLOCK[:7], "feed_forward.w3.weight", "feed_forward.w2.weight"]
    plan = [
        "tok_embeddings.weight",
        *(f"layers.{i}.{name}" for i in range(TINY.n_layers) for name in plan_block),
        "norm.weight",
        "output.weight",
    ]
    by_id = {id(p): n for n, p in model.named_parameters()}
    assert [by_id[id(p)] for p, _ in LLAMA.init_plan(model)] == plan
    moe = MOE.build(SHAPES["moe"])
    assert [n for n, _ in moe.named_parameters()] == list(MOE.hf.parameter_shapes(SHAPES["moe"]))


def test_a_model_without_its_first_blocks_keeps_the_others_names():
    model = LLAMA.build(dataclasses.replace(TINY, n_layers=4))
    del model.layers["0"], model.layers["1"]
    blocks = sorted({n.split(".")[1] for n in model.state_dict() if n.startswith("layers.")})
    assert blocks == ["2", "3"]
    assert [b.layer_id for b in model.layers.values()] == [2, 3]


def run_stages(stages: list[torch.nn.Module], tokens: torch.Tensor, **kwargs) -> torch.Tensor:
    h = tokens
    for stage in stages:
        h = stage(h, **kwargs)
    return h


@pytest.mark.parametrize("family", ["llama", "moe"])
@pytest.mark.parametrize("n_stages", [2, 4])
def test_stages_one_after_another_give_the_whole_models_logits(family, n_stages):
    model = model_of(family)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (2, 24), generator=generator)
    documents = (torch.rand(2, 24, generator=generator) < 0.2).long().cumsum(-1)
    positions = torch.from_numpy(document_positions(documents.numpy())).long()
    kwargs = {"documents": documents, "positions": positions}
    with torch.no_grad():
        whole = model(tokens, **kwargs)
        stages = SPECS[family].pipeline_split(model, n_stages, range(n_stages))
        split = run_stages(stages, tokens, **kwargs)
        # Documents matter: without them the logits differ, so the stages did use them.
        assert not torch.equal(run_stages(stages, tokens), whole)
    assert whole.dtype == torch.float32 and torch.equal(split, whole)

    names = [{n for n, _ in stage.named_parameters()} for stage in stages]
    assert set().union(*names) == {n for n, _ in model.named_parameters()}
    assert sum(map(len, names)) == len(list(model.parameters()))  # disjoint
    assert len(model.layers) == SHAPES[family].n_layers  # every stage: the model left whole


def test_a_rank_holds_the_stages_it_names_in_their_order():
    """An interleaved schedule's rank: stages 3 and 1 of 4, the last with the norm and output."""
    model = model_of("llama")
    whole = dict(model.named_parameters())
    last, second = LLAMA.pipeline_split(model, 4, [3, 1])
    # The model is pruned into the rank's part: its stages' modules under the whole's names,
    # the very parameters the stages train.
    part = dict(model.named_parameters())
    assert list(model.layers) == ["1", "3"] and model.tok_embeddings is None
    assert all(whole[name] is param for name, param in part.items())
    stage_params = {n: p for stage in (last, second) for n, p in stage.named_parameters()}
    assert stage_params.keys() == part.keys()
    assert all(param is part[name] for name, param in stage_params.items())
    assert list(last.layers) == ["3"] and list(second.layers) == ["1"]
    assert last.tok_embeddings is None and last.norm is not None and last.output is not None
    assert second.tok_embeddings is None and second.norm is None and second.output is None
    hidden = torch.randn(2, 8, TINY.dim)
    assert second(hidden).shape == hidden.shape  # hidden states in, hidden states out
    assert last(hidden).shape == (2, 8, TINY.vocab_size)


@pytest.mark.parametrize(
    ("shape", "stages", "message"),
    [
        (
            SHAPES["llama"],
            3,
            "model.n_layers = 4 does not divide into 3 pipeline stages: choose a number of "
            "stages that divides 4",
        ),
        (
            dataclasses.replace(TINY, tie_embeddings=True),
            2,
            "a model with tied embeddings cannot be split into 2 pipeline stages (the first "
            "stage's embedding is the last stage's output): set model.tie_embeddings = false",
        ),
        (TINY, 0, "the number of pipeline stages must be >= 1, got 0"),
    ],
)
def test_a_split_it_cannot_make_is_refused_in_one_line(shape, stages, message):
    with torch.device("meta"):
        model = LLAMA.build(shape)
    with pytest.raises(ConfigError) as refused:
        LLAMA.pipeline_split(model, stages, [0])
    assert str(refused.value) == message


def test_a_tied_model_is_its_own_single_stage():
    model = LLAMA.build(dataclasses.replace(TINY, tie_embeddings=True))
    model.init_weights(0)
    tokens = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(2))
    (stage,) = LLAMA.pipeline_split(model, 1, [0])
    with torch.no_grad():
        assert torch.equal(stage(tokens), model(tokens))
