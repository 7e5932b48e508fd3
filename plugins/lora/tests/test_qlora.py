"""QLoRA, lora.base_dtype = "nf4": the target weights held in torchao's NF4 (half a byte a
value, really), the same whatever the world size, refused where they cannot be; the memory
estimate counts them by ``nf4_bytes`` (the core's test of ``Storage.nbytes`` checks that)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import plugtrain_lora
import pytest
import torch
from plugtrain_lora import Lora, merge
from plugtrain_lora.qlora import UNIT, dequantized, nf4_bytes
from safetensors import safe_open

from plugtrain.plugin import ConfigError, ParallelDims, PluginError, full_tensor
from plugtrain.testing import (
    convert_context,
    hf_llama_folder,
    interrupted_and_resumed,
    make_trainer,
    read_metrics,
    run_distributed,
    setup_context,
)

LORA = ("--plugins.enabled", "lora", "--lora.rank", "4", "--lora.alpha", "8")
QLORA = (*LORA, "--lora.base_dtype", "nf4")
DEBUG = ("--model.flavor", "debug", "--model.ffn_dim", "512")
"""Width 256, a SwiGLU of 512: every target weight holds an even number of NF4 groups."""


def held_bytes(param: torch.Tensor) -> int:
    """The bytes this rank holds of an NF4 parameter (its shard's tensors)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    names = local.__tensor_flatten__()[0]
    return sum(getattr(local, n).numel() * getattr(local, n).element_size() for n in names)


def inner(param: torch.Tensor) -> list[torch.Tensor]:
    """Copies of the tensors an NF4 parameter holds."""
    return [getattr(param, n).clone() for n in param.__tensor_flatten__()[0]]


def targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The SwiGLU's w1 weights (gate_proj: rows in Hugging Face's order), by name."""
    return {n: p for n, p in model.named_parameters() if n.endswith("w1.weight")}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--lora.save_base", "true"),
            r"config key 'lora\.base_dtype' 'nf4' is never saved in a checkpoint, but "
            r"save_base is true: set lora\.save_base = false",
        ),
        ((), r"config key 'lora\.base_dtype' 'nf4' needs torchao: pip install "),
    ],
)
def test_bad_qlora_config_is_one_line(args, message, monkeypatch):
    if not args:
        monkeypatch.setattr(plugtrain_lora, "torchao_missing", lambda: True)
    with pytest.raises(ConfigError, match=message) as e:
        setup_context({}, *QLORA, *args)
    assert "\n" not in str(e.value)


def test_nf4_refuses_weights_it_cannot_hold_as_one_process_does():
    plugin = Lora()

    def refused(*args: str, flavor: str = "debug", dims: ParallelDims | None = None) -> str:
        ctx = convert_context({"lora": plugin}, *QLORA, *args, parallel_dims=dims, flavor=flavor)
        with pytest.raises(PluginError) as e:
            plugin.convert_model(ctx)
        assert "\n" not in str(e.value)
        return str(e.value)

    # The tiny model's 32 x 32 weights hold less than one group of scales.
    tiny = refused(flavor="tiny")
    assert f"in groups of {UNIT} values split whole, which 'layers.0.attention.wq.weight'" in tiny
    assert tiny.endswith("(32 x 32) does not allow: leave 'wq' out of lora.targets, or set "
                         "lora.base_dtype = 'float32'")  # fmt: skip
    # The debug model's SwiGLU (704 x 256) holds 11 groups, which 2 shards cannot split.
    split = refused(dims=ParallelDims(dp_shard=2))
    assert "over parallelism.dp_shard = 2, which 'layers.0.feed_forward.w1.weight' (704" in split
    assert "parallelism.tp = 1" in refused(dims=ParallelDims(tp=2))
    ctx = convert_context({"lora": plugin}, *QLORA, "--lora.targets", "wq,wk", flavor="debug")
    ctx.parallel_dims = ParallelDims(dp_shard=2)
    plugin.convert_model(ctx)
    held = {f"layers.{i}.attention.{m}.weight" for i in range(4) for m in ("wq", "wk")}
    assert set(ctx.conversion.stored) == held and held <= ctx.conversion.unsaved


def test_a_qlora_run_holds_its_base_in_nf4_and_exports_what_it_computed(tmp_path):
    plain = make_trainer(tmp_path / "plain", *LORA, *DEBUG)
    base = {n: p.detach().clone() for n, p in targets(plain.model).items()}
    qlora = make_trainer(tmp_path / "qlora", *QLORA, *DEBUG, steps=2)
    held = targets(qlora.model)
    # Held as NF4, converted from the same weights: half a byte a value and the scales.
    for name, param in held.items():
        assert type(param).__name__ == "NF4Tensor"
        assert held_bytes(param) == nf4_bytes(tuple(param.shape)) < 0.52 * param.numel()
        assert torch.equal(param.get_original_weight(), dequantized(base[name]))
        assert not torch.equal(param.get_original_weight(), base[name])
    before = {n: inner(p) for n, p in held.items()}
    qlora.run()
    assert all(map(torch.equal, inner(p), before[n]) for n, p in held.items())
    losses = [r["loss"] for r in read_metrics(tmp_path / "qlora") if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    # The export merges the adapters into the weights as the run read them back from NF4.
    params = dict(qlora.model.named_parameters())
    nf4 = [n for n, p in params.items() if type(p).__name__ == "NF4Tensor"]
    assert len(nf4) == 7 * qlora.model_args.n_layers and all(".lora_" not in n for n in nf4)
    name = "layers.0.feed_forward.w1"
    adapters = {x: params[f"{name}.lora_{x}"].detach() for x in "ab"}
    assert adapters["b"].abs().max() > 0
    exported = merge("a", "b", 2.0, nf4=True)(base[f"{name}.weight"], adapters)
    computed = params[f"{name}.weight"].get_original_weight() + 2.0 * adapters["b"] @ adapters["a"]
    assert torch.equal(exported, computed)


def from_folder(folder: Path | str) -> tuple[str, ...]:
    return (
        *QLORA, "--training.mixed_precision_param", "bfloat16", "--model.flavor", "hf",
        "--checkpoint.initial_load_path", str(folder), "--model.tokenizer_path", "",
    )  # fmt: skip


def on_two_ranks(root: str, folder: str) -> dict:
    """On each rank: a 10-step bf16 QLoRA run under FSDP2, its losses (rank 0), the bytes
    its rank holds of each target weight's shard, and a hash of the weights read back."""
    trainer = make_trainer(root, *from_folder(folder), steps=10)
    held = targets(trainer.model)
    shards = {n: (held_bytes(p), p.to_local().numel(), type(p).__name__) for n, p in held.items()}
    trainer.run()
    main = trainer.parallel_dims.is_main
    losses = [r["loss"] for r in read_metrics(root) if "loss" in r] if main else []
    weights = [full_tensor(p).get_original_weight() for p in targets(trainer.model).values()]
    return {"losses": losses, "shards": shards, "weights": digest(weights)}


def digest(tensors: list[torch.Tensor]) -> str:
    """A SHA-256 of ``tensors``' bytes."""
    sha = hashlib.sha256()
    for tensor in tensors:
        sha.update(tensor.contiguous().view(torch.uint8).numpy())
    return sha.hexdigest()


@pytest.mark.slow
def test_qlora_on_two_fsdp_ranks_trains_as_one_process_and_resumes_bitwise(tmp_path):
    folder = hf_llama_folder(tmp_path / "base", hidden_size=256, intermediate_size=512)
    exported = ("--plugins.enabled", "lora,hf_export", "--hf_export.every", "last")
    one = interrupted_and_resumed(
        tmp_path / "one", *from_folder(folder), *exported, steps=10, stop_after=5
    )
    assert one["stopped_at"] == one["step_at_resume"] == 5
    assert one["resumed"] == one["straight"]
    straight = [r["loss"] for r in one["straight_metrics"] if "loss" in r]
    assert [r["loss"] for r in one["resumed_metrics"] if "loss" in r] == straight
    # A resume that would hold the base otherwise is refused in one line, naming the setting.
    step10 = tmp_path / "one" / "resumed" / "checkpoints" / "step-10"
    changed = ("--lora.base_dtype", "float32", "--checkpoint.enable", "true")
    with pytest.raises(Exception) as e:
        make_trainer(step10.parent.parent, *from_folder(folder), *changed, steps=10)
    assert str(e.value).startswith(
        f"lora.base_dtype is 'float32' in this run but 'nf4' in checkpoint {step10}, "
    )
    assert type(e.value).__name__ == "CheckpointError" and "\n" not in str(e.value)
    # Two ranks: each weight converted whole, then each rank holding half of it in NF4, so
    # that both compute with the weights one process does (gate_proj's rows are w1's).
    ranks = run_distributed(on_two_ranks, 2, str(tmp_path / "two"), str(folder))
    assert ranks[0]["losses"] == pytest.approx(straight, rel=1e-4)
    gate = [f"model.layers.{i}.mlp.gate_proj.weight" for i in range(2)]
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        original = [f.get_tensor(name).float() for name in gate]
    assert ranks[0]["weights"] == ranks[1]["weights"] == digest(list(map(dequantized, original)))
    for rank in ranks:
        for name, (nbytes, numel, kind) in rank["shards"].items():
            assert kind == "DTensor" and numel == 512 * 256 // 2, name
            assert nbytes < 0.52 * numel
    # The export (hf_export's, at the last checkpoint) re-reads the base and merges the
    # adapters, of rank 4, into it as read back from NF4: not into the original weights.
    export = tmp_path / "one" / "resumed" / "checkpoints" / "step-10" / "hf"
    with safe_open(export / "model.safetensors", framework="pt") as f:
        merged = f.get_tensor(gate[0])
    update = torch.linalg.svdvals(merged - dequantized(original[0]))
    assert update[0] > 1e-3 and update[4] < 1e-6
    assert torch.linalg.svdvals(merged - original[0])[4] > 1e-3
