"""lora on its own: its config, the adapted model against the base and the optimizer's state.

These tests import only the plugin API, the test kit (``plugtrain.testing``) and torch.
"""

from __future__ import annotations

import pytest
import torch
from plugtrain_lora import TARGETS, Lora, LoraLinear

from plugtrain.plugin import ConfigError, ParallelDims, PluginError, additions_off
from plugtrain.testing import convert_context, make_trainer, setup_context

ENABLED = ("--plugins.enabled", "lora")
RANK = ("--lora.rank", "4", "--lora.alpha", "8")


def named(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def adapters(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters() if ".lora_" in name]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--lora.rank", "0"), r"config key 'lora\.rank' must be >= 1, got 0"),
        (("--lora.alpha", "0"), r"config key 'lora\.alpha' must be finite and > 0, got 0"),
        (("--lora.dropout", "1"), r"config key 'lora\.dropout' must be in \[0, 1\), got 1"),
        (
            ("--lora.targets", "wq,wx"),
            r"config key 'lora\.targets' names 'wx', which is no projection: choose among "
            r"wq, wk, wv, wo, w1, w2, w3$",
        ),
        (("--lora.targets", "wq,wq"), r"config key 'lora\.targets' names a projection twice"),
    ],
)
def test_bad_config_is_one_line(args, message):
    with pytest.raises(ConfigError, match=message) as e:
        setup_context({}, *ENABLED, *args)
    assert "\n" not in str(e.value)


def test_the_first_step_sees_the_base_model_bit_for_bit(tmp_path):
    plain = make_trainer(tmp_path / "plain")
    lora = make_trainer(tmp_path / "lora", *ENABLED, *RANK, "--lora.targets", "wq,wo,w2")
    modules = dict(lora.model.named_modules())
    assert type(modules["layers.0.attention.wq"]) is LoraLinear
    assert type(modules["layers.0.attention.wk"]) is torch.nn.Linear
    # Base keys unchanged; the adapters added next to each target's weight.
    base = named(plain.model)
    got = named(lora.model)
    assert sorted(set(got) - set(base)) == sorted(
        f"layers.{i}.{m}.{p}"
        for i in range(lora.model_args.n_layers)
        for m in ("attention.wq", "attention.wo", "feed_forward.w2")
        for p in ("lora_a", "lora_b")
    )
    assert all(torch.equal(got[name], value) for name, value in base.items())
    a = got["layers.0.attention.wq.lora_a"]
    bound = 1 / a.shape[1] ** 0.5  # Kaiming-uniform with a = sqrt(5): nn.Linear's own
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound
    assert not got["layers.0.attention.wq.lora_b"].any()
    tokens = torch.randint(0, lora.model_args.vocab_size, (2, 16), generator=torch.Generator())
    with torch.no_grad():
        assert torch.equal(lora.model(tokens), plain.model(tokens))


def test_the_adapters_switched_off_give_the_base_model_bit_for_bit(tmp_path):
    plain = make_trainer(tmp_path / "plain")
    lora = make_trainer(tmp_path / "lora", *ENABLED, *RANK, steps=2)
    lora.run()  # B moves off zero: the adapted model is no longer the base
    before = named(lora.model)
    tokens = torch.randint(0, lora.model_args.vocab_size, (2, 16), generator=torch.Generator())
    off = additions_off(lora.model)
    assert off is not None and additions_off(plain.model) is None
    with torch.no_grad():
        adapted, base = lora.model(tokens), plain.model(tokens)
        assert not torch.equal(adapted, base)
        for _ in range(2):  # reusable, and on again on exit
            with off:
                assert torch.equal(lora.model(tokens), base)
            assert torch.equal(lora.model(tokens), adapted)
    after = named(lora.model)
    assert all(torch.equal(after[n], t) for n, t in before.items())


def test_only_the_adapters_train_and_the_optimizer_holds_only_them(tmp_path):
    trainer = make_trainer(tmp_path, *ENABLED, *RANK, steps=4)
    names = adapters(trainer.model)
    assert len(names) == 2 * len(TARGETS) * trainer.model_args.n_layers
    before = named(trainer.model)
    trainer.run()
    after = named(trainer.model)
    assert all(torch.equal(after[n], before[n]) for n in before if n not in names)
    assert all(not torch.equal(after[n], before[n]) for n in names if n.endswith("lora_b"))
    params = dict(trainer.model.named_parameters())
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert sorted(map(id, held)) == sorted(id(params[n]) for n in names)
    trainable = sum(params[n].numel() for n in names)
    state = sum(
        t.numel() * t.element_size()
        for s in trainer.optimizer.state.values()
        for key, t in s.items()
        if key != "step"
    )
    assert state == 2 * 4 * trainable
    total = sum(p.numel() for p in params.values())
    assert trainable < 0.1 * total


def test_muon_trains_the_adapters_only(tmp_path):
    trainer = make_trainer(tmp_path, *ENABLED, *RANK, "--plugins.enabled", "lora,muon", steps=2)
    assert trainer.optimizer_builder == "muon"
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    params = dict(trainer.model.named_parameters())
    assert held == {id(params[n]) for n in adapters(trainer.model)}
    before = named(trainer.model)
    trainer.run()
    after = named(trainer.model)
    assert all(torch.equal(after[n], t) for n, t in before.items() if ".lora_" not in n)
    assert not torch.equal(
        after["layers.0.attention.wq.lora_b"], before["layers.0.attention.wq.lora_b"]
    )


def test_dropout_under_tensor_parallelism_is_refused_in_one_line():
    plugin = Lora()
    args = (*ENABLED, "--lora.dropout", "0.1")
    ctx = convert_context({"lora": plugin}, *args, parallel_dims=ParallelDims(tp=2))
    with pytest.raises(PluginError, match=r"set lora\.dropout = 0\.0$") as e:
        plugin.convert_model(ctx)
    assert "\n" not in str(e.value)


def test_the_conversion_adds_and_freezes_and_leaves_the_base_out_of_checkpoints():
    plugin = Lora()
    ctx = convert_context({"lora": plugin}, *ENABLED, "--lora.targets", "wv")
    base = [name for name, _ in ctx.model.named_parameters()]
    plugin.convert_model(ctx)
    assert sorted(ctx.conversion.added) == sorted(
        f"layers.{i}.attention.wv.lora_{x}" for i in range(len(ctx.blocks)) for x in "ab"
    )
    assert set(ctx.conversion.frozen) == set(ctx.conversion.unsaved) == set(base)
    assert ctx.conversion.adapter is not None and ctx.conversion.adapter[0] == "lora"
    saved = convert_context({"lora": plugin}, *ENABLED, "--lora.save_base", "true")
    plugin.convert_model(saved)
    assert saved.conversion.frozen and not saved.conversion.unsaved
