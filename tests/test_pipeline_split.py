"""The blocks keyed by index: the names a model holding some of them keeps."""

from __future__ import annotations

import dataclasses

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
# With a dense block (0) and a shared expert: each kind of block of the moe family.
MOE_SHAPE = dataclasses.replace(
    MOE.flavors["debug_moe"], mlp_only_layers=(0,), ffn_dim=48, shared_ffn_dim=16
)


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
    moe = MOE.build(MOE_SHAPE)
    assert [n for n, _ in moe.named_parameters()] == list(MOE.hf.parameter_shapes(MOE_SHAPE))


def test_a_model_without_its_first_blocks_keeps_the_others_names():
    model = LLAMA.build(dataclasses.replace(TINY, n_layers=4))
    del model.layers["0"], model.layers["1"]
    blocks = sorted({n.split(".")[1] for n in model.state_dict() if n.startswith("layers.")})
    assert blocks == ["2", "3"]
    assert [b.layer_id for b in model.layers.values()] == [2, 3]
