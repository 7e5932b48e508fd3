"""The convert_model phase: a plugin adds parameters and freezes others, and every part of the
core (init, optimizer, gradient hooks, EMA, checkpoints, initial load, export) follows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from plugtrain.checkpoint import (
    CONFIG,
    export_adapter,
    export_checkpoint,
    manager,
    open_checkpoint,
    read_metadata,
)
from plugtrain.cli import main
from plugtrain.commands.generate import load
from plugtrain.errors import CheckpointError, ConfigError, PluginError, UserError
from plugtrain.model import Conversion, Transformer, from_hf
from plugtrain.plugin import (
    AdapterExport,
    ConvertContext,
    MergeInto,
    ShardLike,
    StepContext,
    Storage,
    full_tensor,
    hookimpl,
    total_norm,
    wrap_forward,
)
from plugtrain.testing import (
    convert_context,
    interrupted_and_resumed,
    make_trainer,
    read_metrics,
    run_distributed,
)
from plugtrain.training import estimate_run, saved_conversion

TARGETS = ("layers.0.attention.wq", "layers.1.attention.wo")
RANK, SCALE = 2, 0.5


class Adapter:
    """A LoRA-like adapter on two linears: ``y = W x + SCALE * B (A x)``, the base frozen.

    A is drawn N(0, 0.02^2), B starts at zero (as LoRA's); exported, B @ A * SCALE is merged
    into the linear's weight and A is dropped (B's merge reads it)."""

    def __init__(self, saved: bool = True) -> None:
        self.ctx: ConvertContext | None = None
        self.saved = saved

    @hookimpl
    def convert_model(self, ctx: ConvertContext) -> None:
        self.ctx = ctx
        base = [name for name, _ in ctx.model.named_parameters()]
        for module in TARGETS:
            linear = ctx.model.get_submodule(module)
            out_dim, in_dim = linear.weight.shape
            a_name, b_name = f"{module}.lora_a", f"{module}.lora_b"
            # Under tensor parallelism the factor on the split side is split like the weight:
            # B's output rows for column-wise wq, A's input columns for row-wise wo. wq names
            # its styles; wo's follow the plan, each factor by the dimension it shares.
            weight = f"{module}.weight"
            column_wise = module.endswith("wq")
            a_style = "replicate" if column_wise else ShardLike(weight, dim=1)
            b_style = ShardLike(weight) if column_wise else ShardLike(weight, dim=0)

            def merge(weight, added, a_name=a_name, b_name=b_name):
                return weight + SCALE * added[b_name] @ added[a_name]

            ctx.add_parameter(
                self,
                module,
                "lora_a",
                (RANK, in_dim),
                init=lambda t, g: t.normal_(0.0, 0.02, generator=g),
                tp=a_style,
                export="drop",
            )
            ctx.add_parameter(
                self,
                module,
                "lora_b",
                (out_dim, RANK),
                init=lambda t, g: t.zero_(),
                tp=b_style,
                export=MergeInto(f"{module}.weight", merge),
            )

            def adapted(forward, linear=linear):
                def run(x):
                    return forward(x) + SCALE * (x @ linear.lora_a.T) @ linear.lora_b.T

                return run

            wrap_forward(linear, adapted)
        ctx.freeze(self, *base, saved=self.saved)
        ctx.set_adapter(self, self.write)

    @staticmethod
    def write(export: AdapterExport) -> None:
        """The adapter folder: each added tensor under its weight's Hugging Face name."""
        tensors = {}
        for name, tensor in export.tensors.items():
            module, _, short = name.rpartition(".")
            hf_name = export.to_hf(f"{module}.weight", torch.empty(0))[0]
            tensors[f"{hf_name}.{short}"] = tensor.to(export.dtype)
        torch.save(tensors, export.folder / "adapter.pt")


def adapters() -> list:
    return [("adapter", Adapter())]


def added_names() -> list[str]:
    return sorted(f"{m}.{p}" for m in TARGETS for p in ("lora_a", "lora_b"))


def named(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_the_base_stays_bitwise_and_only_the_adapters_train(tmp_path):
    plain = make_trainer(tmp_path / "plain")
    trainer = make_trainer(tmp_path / "lora", plugins=adapters())
    before = named(trainer.model)
    base = named(plain.model)
    # The base weights are drawn as in a run without the plugin.
    assert all(torch.equal(before[name], value) for name, value in base.items())
    assert sorted(set(before) - set(base)) == added_names()
    trainer.run()
    after = named(trainer.model)
    assert all(torch.equal(after[name], before[name]) for name in base)
    assert all(not torch.equal(after[name], before[name]) for name in added_names())
    # The optimizer holds the adapters only: AdamW's two moments of 4 bytes each.
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    params = dict(trainer.model.named_parameters())
    assert held == {id(params[name]) for name in added_names()}
    trainable = sum(params[name].numel() for name in added_names())
    moments = sum(
        t.numel() * t.element_size()
        for state in trainer.optimizer.state.values()
        for key, t in state.items()
        if key != "step"
    )
    assert moments == 2 * 4 * trainable
    assert trainer.params == tuple(params[n] for n in params if n in added_names())


def test_the_kits_convert_context_runs_a_plugins_convert_model():
    adapter = Adapter()
    ctx = convert_context({"adapter": adapter})
    adapter.convert_model(ctx)
    assert sorted(ctx.conversion.added) == added_names()
    assert ctx.model.get_submodule("layers.0.attention.wq").lora_a.is_meta
    assert not any(p.requires_grad for n, p in ctx.model.named_parameters() if "lora" not in n)


class EveryParameter:
    """Builds AdamW over the whole model, frozen parameters included: against the contract."""

    @hookimpl
    def build_optimizer(self, ctx):
        params = [p for name, p in ctx.named_parameters]
        frozen = [p for p in self.model.parameters() if not p.requires_grad]
        return torch.optim.AdamW(params + frozen, lr=ctx.learning_rate(1e-3))

    @hookimpl
    def convert_model(self, ctx: ConvertContext) -> None:
        self.model = ctx.model


def test_muon_holds_the_trainable_parameters_and_a_plugin_optimizer_must_too(tmp_path):
    trainer = make_trainer(tmp_path / "muon", "--plugins.enabled", "muon", plugins=adapters())
    held = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert trainer.optimizer_builder == "muon"
    assert sorted(map(id, held)) == sorted(map(id, trainer.params)) and len(held) == 4
    trainer.run()
    with pytest.raises(PluginError, match=r"trains 4: it must hold each of ctx\.named_parameters"):
        make_trainer(tmp_path / "every", plugins=[*adapters(), ("every", EveryParameter())])


def test_the_added_parameters_init_is_seeded_and_reproducible(tmp_path):
    one = named(make_trainer(tmp_path / "one", plugins=adapters()).model)
    two = named(make_trainer(tmp_path / "two", plugins=adapters()).model)
    other = named(make_trainer(tmp_path / "seed", "--training.seed", "7", plugins=adapters()).model)
    a = "layers.0.attention.wq.lora_a"
    assert all(torch.equal(one[name], two[name]) for name in added_names())
    assert not torch.equal(one[a], other[a])
    assert 0.015 < one[a].std() < 0.025
    assert not one["layers.0.attention.wq.lora_b"].any()


class NormProbe:
    """Records the norm of the step hooks' gradients, before grad_clip modifies them."""

    def __init__(self) -> None:
        self.norms: list[torch.Tensor] = []
        self.count = 0

    @hookimpl
    def observe_gradients(self, ctx: StepContext) -> None:
        self.count = len(ctx.params)
        assert all(p.requires_grad for p in ctx.params)
        self.norms.append(total_norm(ctx.gradients()))


def test_grad_clip_and_ema_cover_the_trainable_parameters(tmp_path):
    probe = NormProbe()
    trainer = make_trainer(
        tmp_path,
        "--plugins.enabled", "grad_clip,ema",
        "--grad_clip.max_norm", "1e-4",
        plugins=[*adapters(), ("probe", probe)],
    )  # fmt: skip
    trainer.run()
    assert probe.count == len(added_names())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    norms = [r["grad_clip/grad_norm"] for r in records if "grad_clip/grad_norm" in r]
    assert norms == pytest.approx([float(n) for n in probe.norms], rel=1e-6)
    ema = trainer.host.get("ema")
    assert sorted(ema.average) == added_names()


def test_a_resume_is_bitwise_equal_to_the_uninterrupted_run(tmp_path):
    result = interrupted_and_resumed(tmp_path, steps=4, stop_after=2, plugins=adapters)
    assert result["stopped_at"] == result["step_at_resume"] == 2
    assert result["resumed"] == result["straight"]

    def losses(records):
        return [(r["step"], r["loss"], r["lr"]) for r in records if "loss" in r]

    assert losses(result["resumed_metrics"]) == losses(result["straight_metrics"])


def unsaved_adapters() -> list:
    return [("adapter", Adapter(saved=False))]


def test_a_base_left_out_of_checkpoints_is_reread_from_the_initial_load(tmp_path):
    plain = make_trainer(tmp_path / "plain", *CHECKPOINTED)
    plain.run()
    source = tmp_path / "plain" / "checkpoints" / "step-3"
    initial = ("--checkpoint.initial_load_path", str(source))
    result = interrupted_and_resumed(
        tmp_path, *initial, steps=4, stop_after=2, plugins=unsaved_adapters
    )
    assert result["stopped_at"] == result["step_at_resume"] == 2
    assert result["resumed"] == result["straight"]
    step = tmp_path / "resumed" / "checkpoints" / "step-4"
    keys = set(read_metadata(step).state_dict_metadata)
    assert {k for k in keys if k.startswith("model.")} == {f"model.{n}" for n in added_names()}
    assert "base.sha256" in keys
    # The export and generate re-read the base too.
    lora = result["plugins"]["adapter"]
    host = make_trainer(tmp_path / "host", *initial, plugins=[("adapter", lora)]).host
    conversion = saved_conversion(open_checkpoint(step), "model", host=host)
    export_checkpoint(step, tmp_path / "hf", conversion=conversion)
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        norm = f.get_tensor("model.norm.weight")
    assert torch.equal(norm, dict(plain.model.named_parameters())["norm.weight"].detach())
    # A changed base is refused in one line, by a resume and by the export.
    with open(source / CONFIG, "a") as f:
        f.write(" ")
    with pytest.raises(CheckpointError, match="is not the base checkpoint") as e:
        make_trainer(tmp_path / "resumed", *initial, *CHECKPOINTED, plugins=unsaved_adapters())
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="is not the base checkpoint"):
        export_checkpoint(step, tmp_path / "hf-changed", conversion=conversion)
    assert not (tmp_path / "hf-changed").exists()


def test_a_base_that_cannot_be_hashed_stops_the_run_in_one_line(tmp_path, monkeypatch):
    plain = make_trainer(tmp_path / "plain", *CHECKPOINTED)
    plain.run()
    source = tmp_path / "plain" / "checkpoints" / "step-3"

    def unreadable(_source):
        raise PermissionError(13, "Permission denied", str(source / CONFIG))

    monkeypatch.setattr(manager, "source_digest", unreadable)
    initial = ("--checkpoint.initial_load_path", str(source))
    trainer = make_trainer(tmp_path / "run", *initial, *CHECKPOINTED, plugins=unsaved_adapters())
    with pytest.raises(CheckpointError) as e:
        trainer.run()
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"cannot read checkpoint.initial_load_path '{source}' to hash ")
    assert "Permission denied" in message and message.endswith(": check the folder")


def checkpoint_keys(folder) -> set[str]:
    return set(read_metadata(folder / "checkpoints" / "step-3").state_dict_metadata)


CHECKPOINTED = ("--checkpoint.enable", "true", "--checkpoint.interval", "3")


def test_checkpoints_keep_the_base_keys_and_export_merges_the_adapters(tmp_path):
    plain = make_trainer(tmp_path / "plain", *CHECKPOINTED)
    plain.run()
    lora = make_trainer(tmp_path / "lora", *CHECKPOINTED, plugins=adapters())
    lora.run()
    plain_keys, lora_keys = checkpoint_keys(tmp_path / "plain"), checkpoint_keys(tmp_path / "lora")
    model_keys = {k for k in plain_keys if k.startswith("model.")}
    assert {k for k in lora_keys if k.startswith("model.")} == model_keys | {
        f"model.{n}" for n in added_names()
    }
    moments = {k for k in lora_keys if k.startswith("optimizer.state.")}
    assert moments == {
        f"optimizer.state.{n}.{s}" for n in added_names() for s in ("exp_avg", "exp_avg_sq", "step")
    }

    # Offline, as `plugtrain export-hf` does: the saved config's plugins rebuild the rules.
    saved = open_checkpoint(tmp_path / "lora")
    assert saved_conversion(open_checkpoint(tmp_path / "plain"), "model") is None
    conversion = saved_conversion(saved, "model", host=lora.host)
    assert conversion is not None and sorted(conversion.added) == added_names()
    export_checkpoint(tmp_path / "lora", tmp_path / "hf", conversion=conversion)
    # Its saved config enables no plugin (the adapter was registered by the test): the format
    # has no place for the adapters. A plugin of several missing is named as such.
    for partial, why in (
        (saved_conversion(saved, "model"), "has no place in the Hugging Face Llama format"),
        (saved_conversion(saved, "model", host=lora.host), "neither the model nor a plugin"),
    ):
        if partial is not None and partial.added:
            del partial.added["layers.0.attention.wq.lora_a"]
        with pytest.raises(UserError, match=why) as e:
            export_checkpoint(tmp_path / "lora", tmp_path / "nowhere", conversion=partial)
        assert "\n" not in str(e.value) and not (tmp_path / "nowhere").exists()
    export_checkpoint(tmp_path / "plain", tmp_path / "hf-plain")
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    with safe_open(tmp_path / "hf-plain" / "model.safetensors", framework="pt") as f:
        assert sorted(tensors) == sorted(f.keys())  # the adapters are dropped
    params = dict(lora.model.named_parameters())
    for module in TARGETS:
        w, a, b = (params[f"{module}.{p}"].detach() for p in ("weight", "lora_a", "lora_b"))
        assert b.abs().max() > 0  # trained: the merge is not a no-op
        hf_name = "model.layers.{}.self_attn.{}.weight".format(
            module.split(".")[1], {"wq": "q_proj", "wo": "o_proj"}[module.rsplit(".", 1)[1]]
        )
        ours = from_hf(hf_name, tensors[hf_name], lora.model_args)[1]
        torch.testing.assert_close(ours, w + b @ a * SCALE, rtol=0, atol=1e-6)

    # The merged folder, loaded into a plain model, gives the adapted model's logits.
    merged = make_trainer(
        tmp_path / "merged", "--checkpoint.initial_load_path", str(tmp_path / "hf")
    )
    tokens = torch.randint(0, lora.model_args.vocab_size, (2, 16), generator=torch.Generator())
    with torch.no_grad():
        torch.testing.assert_close(merged.model(tokens), lora.model(tokens), rtol=0, atol=1e-5)


def test_an_adapter_export_writes_what_the_plugin_writes_and_needs_one(tmp_path, capsys):
    lora = make_trainer(tmp_path / "lora", *CHECKPOINTED, plugins=adapters())
    lora.run()
    conversion = saved_conversion(open_checkpoint(tmp_path / "lora"), "model", host=lora.host)
    export_adapter(tmp_path / "lora", tmp_path / "out", dtype=torch.bfloat16, conversion=conversion)
    written = torch.load(tmp_path / "out" / "adapter.pt")
    params = dict(lora.model.named_parameters())
    expected = {
        "model.layers.0.self_attn.q_proj.weight.lora_a": "layers.0.attention.wq.lora_a",
        "model.layers.0.self_attn.q_proj.weight.lora_b": "layers.0.attention.wq.lora_b",
        "model.layers.1.self_attn.o_proj.weight.lora_a": "layers.1.attention.wo.lora_a",
        "model.layers.1.self_attn.o_proj.weight.lora_b": "layers.1.attention.wo.lora_b",
    }
    assert sorted(written) == sorted(expected)
    for key, name in expected.items():
        assert torch.equal(written[key], params[name].detach().to(torch.bfloat16))
    # A run whose plugins set no adapter writer: one line, exit 2, nothing written.
    make_trainer(tmp_path / "plain", *CHECKPOINTED).run()
    out = tmp_path / "nothing"
    assert main(["export-hf", str(tmp_path / "plain"), "-o", str(out), "--adapter"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith(
            "holds no adapter (no plugin of its run, such as lora, writes one): export the whole "
            "model without --adapter"
        )
    )
    assert not out.exists() and not out.with_name("nothing.partial").exists()


def test_generate_and_eval_load_a_converted_run_with_its_additions_merged(tmp_path):
    lora = ("--plugins.enabled", "lora,ema", "--optimizer.lr", "1e-2")
    trainer = make_trainer(tmp_path, *CHECKPOINTED, *lora)
    trainer.run()
    tokens = torch.randint(0, trainer.model_args.vocab_size, (2, 16), generator=torch.Generator())
    plain = make_trainer(tmp_path / "plain")
    with torch.no_grad():
        expected, base = trainer.model.eval()(tokens), plain.model(tokens)
        merged = load(tmp_path)[0](tokens)
        ema = load(tmp_path, weights="ema")[0](tokens)  # the frozen base from the model's
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-5)
    assert (merged - base).abs().max() > 1e-3
    assert (ema - base).abs().max() > 0 and (ema - merged).abs().max() > 0


def test_the_ema_export_takes_the_frozen_weights_from_the_model(tmp_path):
    ema = ("--plugins.enabled", "ema", "--ema.decay", "0.5")
    trainer = make_trainer(tmp_path / "run", *CHECKPOINTED, *ema, plugins=adapters())
    trainer.run()
    average = trainer.host.get("ema").average
    conversion = saved_conversion(open_checkpoint(tmp_path / "run"), "ema", host=trainer.host)
    export_checkpoint(tmp_path / "run", tmp_path / "hf", weights="ema", conversion=conversion)
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        norm, wo = (
            f.get_tensor("model.norm.weight"),
            f.get_tensor("model.layers.1.self_attn.o_proj.weight"),
        )
    params = dict(trainer.model.named_parameters())
    assert torch.equal(norm, params["norm.weight"].detach())  # frozen: the model's own
    module = "layers.1.attention.wo"
    merged = params[f"{module}.weight"].detach() + SCALE * (
        average[f"{module}.lora_b"] @ average[f"{module}.lora_a"]
    )
    torch.testing.assert_close(wo, merged, rtol=0, atol=1e-6)  # the averaged adapters


def test_an_initial_load_fills_the_base_and_the_adapters_keep_their_init(tmp_path):
    plain = make_trainer(tmp_path / "plain", *CHECKPOINTED)
    plain.run()
    fresh = named(make_trainer(tmp_path / "fresh", plugins=adapters()).model)
    source = str(tmp_path / "plain" / "checkpoints" / "step-3")
    loaded = make_trainer(
        tmp_path / "loaded", "--checkpoint.initial_load_path", source, plugins=adapters()
    )
    got, trained = named(loaded.model), named(plain.model)
    assert all(torch.equal(got[name], value) for name, value in trained.items())
    assert all(torch.equal(got[name], fresh[name]) for name in added_names())
    with pytest.raises(CheckpointError, match="initial_load_model_only = true"):
        make_trainer(
            tmp_path / "state",
            "--checkpoint.initial_load_path", source,
            "--checkpoint.initial_load_model_only", "false",
            plugins=adapters(),
        )  # fmt: skip


def test_the_memory_estimate_counts_gradients_and_moments_of_trainable_parameters(tmp_path):
    trainer = make_trainer(tmp_path, plugins=adapters())
    full = estimate_run(trainer.config, 1)
    converted = estimate_run(trainer.config, 1, model=trainer.model)
    parts = {name: size for name, size, _ in converted.parts}
    trainable = sum(p.numel() for p in trainer.params)
    total = sum(p.numel() for p in trainer.model.parameters())
    assert parts["gradients"] == 4 * trainable and parts["optimizer"] == 8 * trainable
    assert parts["parameters"] == 4 * total > dict((n, s) for n, s, _ in full.parts)["parameters"]
    # `plugtrain estimate` has no model: the run's plugins convert one on the meta device.
    assert estimate_run(trainer.config, 1, host=trainer.host).parts == converted.parts


HALVED = Storage("halved", lambda t: t / 2, lambda shape: 2 * math.prod(shape))
"""A stand-in for NF4 in float32 (any form computes here): each weight held halved, 2 bytes
counted a parameter."""


class Halved:
    """Holds the blocks' wq weights in form ``HALVED``, frozen."""

    @hookimpl
    def convert_model(self, ctx: ConvertContext) -> None:
        names = [f"layers.{i}.attention.wq.weight" for i in range(len(ctx.blocks))]
        ctx.freeze(self, *names, storage=HALVED)


def test_a_stored_parameter_is_held_in_its_form_whatever_fills_it(tmp_path):
    plain = make_trainer(tmp_path / "plain", *CHECKPOINTED)
    wq = [f"layers.{i}.attention.wq.weight" for i in range(plain.model_args.n_layers)]
    initial = {name: p.detach().clone() for name, p in plain.model.named_parameters()}
    # The init (under FSDP2 on one shard: held whole, out of FSDP2's reach), then the
    # initial load of a plugtrain checkpoint with the optimizer state.
    bf16 = ("--training.mixed_precision_param", "bfloat16")
    held = make_trainer(tmp_path / "held", *bf16, plugins=[("halved", Halved())])
    params = dict(held.model.named_parameters())
    assert all(torch.equal(params[n], initial[n] / 2) for n in wq)
    assert all(type(params[n]) is torch.nn.Parameter for n in wq)
    assert all(torch.equal(full_tensor(p), initial[n]) for n, p in params.items() if n not in wq)
    plain.run()
    trained = {name: p.detach() for name, p in plain.model.named_parameters()}
    step = tmp_path / "plain" / "checkpoints" / "step-3"
    load = ("--checkpoint.initial_load_path", str(step))
    loaded = make_trainer(tmp_path / "loaded", *load, plugins=[("halved", Halved())])
    params = dict(loaded.model.named_parameters())
    assert all(torch.equal(params[n], trained[n] / 2) for n in wq)
    assert all(torch.equal(p, trained[n]) for n, p in params.items() if n not in wq)
    # The estimate counts the form's bytes: 2 a parameter rather than 4.
    parts = {n: size for n, size, _ in estimate_run(held.config, 1, model=held.model).parts}
    total = sum(p.numel() for p in params.values())
    assert parts["parameters"] == 4 * total - 2 * sum(params[n].numel() for n in wq)
    # A run that saves checkpoints needs an initial load to read them back from.
    refused = r"holds 'layers\.0\.attention\.wq\.weight' as halved, which a checkpoint never"
    with pytest.raises(ConfigError, match=refused) as e:
        make_trainer(tmp_path / "refused", *CHECKPOINTED, plugins=[("halved", Halved())])
    assert "\n" not in str(e.value) and not (tmp_path / "refused" / "checkpoints").exists()


class Late(Adapter):
    """Keeps the context and adds a parameter after the hook."""


class BadTarget:
    @hookimpl
    def convert_model(self, ctx: ConvertContext) -> None:
        ctx.add_parameter(
            self,
            "layers.0.attention.wq",
            "extra",
            (2, 2),
            init=lambda t, g: t.zero_(),
            tp=None,
            export=MergeInto("layers.0.attention.nothing", lambda w, added: w),
        )


def test_one_line_refusals(tmp_path):
    late = Late()
    make_trainer(tmp_path / "late", plugins=[("late", late)])
    assert late.ctx is not None and late.ctx.parallel_dims.world_size == 1
    with pytest.raises(PluginError, match="outside convert_model") as e:
        late.ctx.add_parameter(late, "norm", "x", (1,), init=lambda t, g: t, tp=None, export="drop")
    assert "\n" not in str(e.value)
    with pytest.raises(PluginError, match="no base parameter") as e:
        make_trainer(tmp_path / "bad", plugins=[("bad", BadTarget())])
    assert "\n" not in str(e.value)
    # A parameter without a tensor-parallel style refuses parallelism.tp above 1.
    args = make_trainer(tmp_path / "args").model_args
    with torch.device("meta"):
        model = Transformer(args)
    conversion = Conversion(open=True)
    conversion.add(model, "p", "norm", "x", (1,), lambda t, g: t, None, "drop")
    refused = pytest.raises(PluginError, match=r"set parallelism\.tp = 1")
    with refused as e, conversion.tensor_parallel(model, None):  # type: ignore[arg-type]
        pass
    assert "\n" not in str(e.value)
    # Additions switch off only when every plugin that added parameters can switch them.
    assert conversion.switched_off() is None
    flips: list[tuple[str, bool]] = []
    conversion.set_switch("q", lambda on: flips.append(("q", on)))
    with pytest.raises(PluginError, match=r"plugin 'p' adds 'norm\.x' but cannot switch it off"):
        conversion.switched_off()
    conversion.set_switch("p", lambda on: flips.append(("p", on)))
    with conversion.switched_off():  # type: ignore[union-attr]
        assert flips == [("q", False), ("p", False)]
    assert flips[2:] == [("q", True), ("p", True)]
    # One adapter writer per run.
    conversion.set_adapter("p", print)
    with pytest.raises(PluginError, match="plugins 'p' and 'q' both write the run's adapter"):
        conversion.set_adapter("q", print)
    # A factor split like a base along a dimension it shares with it, of the same size.
    like = ShardLike("layers.0.attention.wq.weight", dim=0)
    with pytest.raises(PluginError, match="along dimension 0, which they do not share") as e:
        conversion.add(
            model, "p", "layers.0.attention.wq", "y", (3, 2), lambda t, g: t, like, "drop"
        )
    assert "\n" not in str(e.value)


def tensor_parallel_run(root: str) -> dict:
    """Run on each of 2 ranks: the adapted model under tp 2; its losses and adapter placements."""
    trainer = make_trainer(Path(root), "--parallelism.tp", "2", steps=4, plugins=adapters())
    before = {n: full_tensor(p).clone() for n, p in trainer.model.named_parameters()}
    trainer.run()
    params = dict(trainer.model.named_parameters())
    return {
        "placements": {n: str(params[n].placements) for n in added_names()},
        "base_unchanged": all(
            torch.equal(full_tensor(params[n]), before[n]) for n in before if "lora" not in n
        ),
        "losses": [r["loss"] for r in read_metrics(root) if "loss" in r],
    }


@pytest.mark.slow
def test_adapters_under_tensor_parallelism_train_as_one_process(tmp_path):
    one = make_trainer(tmp_path / "one", steps=4, plugins=adapters())
    one.run()
    expected = [r["loss"] for r in read_metrics(tmp_path / "one") if "loss" in r]
    ranks = run_distributed(tensor_parallel_run, 2, str(tmp_path / "tp"))
    assert ranks[0]["losses"] == pytest.approx(expected, rel=1e-5)
    assert all(rank["base_unchanged"] for rank in ranks)
    placements = ranks[0]["placements"]
    # Column-wise wq: B split by its output rows, A whole; row-wise wo: A split by its inputs.
    assert placements["layers.0.attention.wq.lora_b"] == "(Shard(dim=0),)"
    assert placements["layers.0.attention.wq.lora_a"] == "(Replicate(),)"
    assert placements["layers.1.attention.wo.lora_a"] == "(Shard(dim=1),)"
    assert placements["layers.1.attention.wo.lora_b"] == "(Replicate(),)"
