"""dpo: its config, the loss of preference pairs against a frozen reference, in real runs.

These tests import only the plugin API and the test kit (``plugtrain.testing``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from plugtrain_dpo import METRICS, Dpo
from torch.distributed.tensor import DTensor

from plugtrain.plugin import IGNORE_INDEX, ConfigError, PluginError, SetupContext, full_tensor
from plugtrain.testing import (
    SAMPLE,
    interrupted_and_resumed,
    make_trainer,
    read_metrics,
    run_distributed,
    setup_context,
)

NAME = "dpo"
ENABLED = ("--plugins.enabled", NAME)
PAIRS = ("--data.train_path", str(SAMPLE / "preference_train.jsonl"), "--training.seq_len", "256")
RUN = (*ENABLED, *PAIRS, "--training.batch_size", "4")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("--dpo.reference", "frozen"),
            r"must be one of \('copy', 'adapters_off', 'precomputed'\)",
        ),
        (("--dpo.loss_type", "kto"), r"must be one of \('sigmoid', 'ipo'\), got 'kto'"),
        (("--dpo.beta", "0"), "must be finite and > 0, got 0"),
        (("--dpo.label_smoothing", "0.5"), r"must be in \[0, 0.5\), got 0.5"),
    ],
)
def test_the_config_is_checked_in_one_line(args, message):
    with pytest.raises(ConfigError, match=message):
        setup_context({}, *ENABLED, *args)


def test_text_data_to_a_dpo_run_is_refused_before_step_one(tmp_path):
    with pytest.raises(PluginError, match="plugin 'dpo' trains on preference pairs, but the "):
        make_trainer(tmp_path, *ENABLED)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_adapters_off_without_lora_is_refused_before_step_one(tmp_path):
    refused = "dpo.reference = 'adapters_off' needs a plugin that adds adapters, e.g. lora: "
    with pytest.raises(PluginError, match=refused) as e:
        make_trainer(tmp_path, *RUN, "--dpo.reference", "adapters_off")
    assert "\n" not in str(e.value) and not (tmp_path / "metrics.jsonl").exists()


def losses(folder: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(folder) if "loss" in r]


def test_step_one_is_ln2_and_the_reference_stays_as_it_was(tmp_path):
    plugin = Dpo()
    trainer = make_trainer(tmp_path, *RUN, steps=3, plugins=[(NAME, plugin)])
    before = [p.detach().clone() for p in plugin.reference.parameters()]
    trainer.run()
    records = [r for r in read_metrics(tmp_path) if "loss" in r]
    assert abs(records[0]["loss"] - math.log(2)) < 1e-6
    assert records[0]["dpo/margin"] == 0 and records[0]["dpo/rewards_chosen"] == 0
    assert all({f"dpo/{m}" for m in METRICS} <= set(r) for r in records)
    after = list(plugin.reference.parameters())
    assert all(
        torch.equal(a, b) and not a.requires_grad for a, b in zip(after, before, strict=True)
    )
    assert all(p.grad is None for p in after)
    moved = trainer.model.parameters()
    assert not any(torch.equal(p, b) for p, b in zip(moved, before, strict=True))


LORA = ("--plugins.enabled", "lora,dpo", "--lora.rank", "4")


def _no_frozen_copy(self: SetupContext) -> None:
    raise AssertionError("adapters_off built a frozen copy")


def test_adapters_off_is_the_copy_with_no_second_model(tmp_path, monkeypatch):
    """With lora, the policy with its adapters off is the frozen base: the losses of 2 steps
    are the copy reference's, step 1's ln 2, and no copy is built or saved."""
    copy = make_trainer(tmp_path / "copy", *RUN, *LORA, steps=2)
    copy.run()
    copy.close()

    monkeypatch.setattr(SetupContext, "frozen_copy", _no_frozen_copy)
    plugin = Dpo()
    off = make_trainer(
        tmp_path / "off", *RUN, *LORA, "--dpo.reference", "adapters_off", steps=2,
        plugins=[(NAME, plugin)],
    )  # fmt: skip
    off.run()
    assert plugin.reference is None and plugin.state_dict() is None
    mine, theirs = losses(tmp_path / "off"), losses(tmp_path / "copy")
    assert len(mine) == 2 and abs(mine[0] - math.log(2)) < 1e-6
    assert all(abs(a - b) < 1e-6 for a, b in zip(mine, theirs, strict=True)), (mine, theirs)
    # Step 2's policy has moved off the reference (the adapters on would give ln 2 again).
    assert abs(mine[1] - math.log(2)) > 1e-4
    off.close()


def test_the_loss_falls_and_the_chosen_reward_rises_on_a_batch_trained_again(tmp_path):
    trainer = make_trainer(tmp_path, *RUN, "--lr_scheduler.warmup_steps", "0", steps=10)
    batch = trainer.batches.next_batch()
    losses, margins = [], []
    for _ in range(10):
        loss, ctx = trainer.train_step(batch)
        losses.append(loss.item())
        margins.append(trainer.host.results("step_metrics", ctx=ctx)[NAME]["margin"].item())
    assert abs(losses[0] - math.log(2)) < 1e-6 and margins[0] == 0
    assert losses[-1] < losses[0] - 0.1 and all(m > 0 for m in margins[1:]), (losses, margins)
    trainer.close()


def hand_loss(logps: dict[str, torch.Tensor], beta: float) -> torch.Tensor:
    """DPO's sigmoid loss of one pair from its four summed log-probabilities."""
    h = (logps["policy_c"] - logps["ref_c"]) - (logps["policy_r"] - logps["ref_r"])
    return -F.logsigmoid(beta * h)


@pytest.mark.slow  # transformers and an HF folder: seconds
def test_a_pairs_loss_is_the_hand_computation_from_transformers_log_probs(tmp_path):
    transformers = pytest.importorskip("transformers")
    from plugtrain.testing.hf import hf_llama_folder

    folder = hf_llama_folder(tmp_path / "llama", vocab_size=2053)
    plugin = Dpo()
    trainer = make_trainer(
        tmp_path / "run",
        *RUN,
        *("--model.flavor", "hf", "--checkpoint.initial_load_path", str(folder)),
        *("--model.tokenizer_path", str(folder / "tokenizer.json"), "--dpo.beta", "0.5"),
        plugins=[(NAME, plugin)],
    )
    # The policy moves off the reference: its final norm scaled, in both worlds.
    with torch.no_grad():
        trainer.model.norm.weight.mul_(1.5)
    microbatch = trainer.batches.next_batch()[0]
    with torch.no_grad():
        ours = plugin(trainer.model, microbatch, 0)
    hf = {}
    for name, scale in (("ref", 1.0), ("policy", 1.5)):
        model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            model.model.norm.weight.mul_(scale)
        hf[name] = model
    theirs, pairs = torch.zeros(()), 0
    for row in range(microbatch.inputs.shape[0]):
        docs = microbatch.documents[row]
        for pair in range(0, int(docs.max()) + 1, 2):
            logps = {}
            for side, doc in (("c", pair), ("r", pair + 1)):
                at = (docs == doc).nonzero().flatten()
                ids = microbatch.inputs[row, at[0] : at[-1] + 1]
                targets = microbatch.targets[row, at[0] : at[-1] + 1]
                if (targets != IGNORE_INDEX).sum() == 0:
                    break  # a padding document
                counted = targets != IGNORE_INDEX
                for name, model in hf.items():
                    with torch.no_grad():
                        logits = model(ids[None]).logits[0]
                    picked = logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[:, None])
                    logps[f"{name}_{side}"] = picked[:, 0][counted].sum()
            if len(logps) == 4:
                theirs, pairs = theirs + hand_loss(logps, 0.5), pairs + 1
    assert pairs == int(plugin.units(microbatch)) > 0
    assert abs(theirs - math.log(2) * pairs) > 1e-3  # the policy is not the reference
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    trainer.close()


def layout(module: torch.nn.Module) -> list[str]:
    """Each parameter's placements, as text ("plain" for a plain tensor)."""
    return [str(p.placements) if isinstance(p, DTensor) else "plain" for p in module.parameters()]


class LayoutChecked(Dpo):
    """Dpo that records, after each microbatch, its reference parameters' layout (FSDP2 leaves
    the root gathered, plain tensors, after a forward unless resharded)."""

    def __init__(self) -> None:
        super().__init__()
        self.layouts: list[list[str]] = []

    def __call__(self, model, microbatch, index):
        loss = super().__call__(model, microbatch, index)
        self.layouts.append(layout(self.reference))
        return loss


def _trained(folder: str, accum: int, *args: str) -> dict:
    """Train 10 fp32 steps of 8 rows in ``accum`` microbatches, validated after the last;
    what this rank saw."""
    plugin = LayoutChecked()
    # grad_clip clips every step; grad_scaler stays inactive in fp32.
    clipped = ("--plugins.enabled", "dpo,grad_clip,grad_scaler", "--grad_clip.max_norm", "0.05")
    held_out = ("--validation.interval", "10", "--validation.steps", "1",
                "--data.validation_path", str(SAMPLE / "preference_validation.jsonl"))  # fmt: skip
    trainer = make_trainer(
        folder, *RUN, *clipped, *held_out, *args,
        *("--training.batch_size", "8", "--training.grad_accum_steps", str(accum)),
        steps=10, plugins=[(NAME, plugin)],
    )  # fmt: skip
    model = layout(trainer.model)  # as set up: every parameter sharded or split
    start = [full_tensor(p).clone() for p in plugin.reference.parameters()]
    trainer.run()
    after = [full_tensor(p) for p in plugin.reference.parameters()]
    unchanged = all(torch.equal(a, b) for a, b in zip(after, start, strict=True))
    trainer.close()
    # 2 microbatches a step, and the validation batch.
    laid_out = len(plugin.layouts) == 21 and all(seen == model for seen in plugin.layouts)
    validation = [r["validation_loss"] for r in read_metrics(folder) if "validation_loss" in r]
    return {"losses": losses(Path(folder)), "validation": validation, "model": model,
            "laid_out": laid_out, "unchanged": unchanged}  # fmt: skip


LAYOUTS = {
    "fsdp": (),
    "hsdp": ("--parallelism.dp_replicate", "2"),
    "tp": ("--parallelism.tp", "2"),
}
"""The 2-process layouts: FSDP2 over both ranks; HSDP (2 replicas of 1 shard); tensor
parallelism over both (the logits split over the vocabulary)."""


def _layouts(folder: str) -> dict[str, dict]:
    """On each of 2 ranks, 2 microbatches a step: each of ``LAYOUTS``."""
    return {name: _trained(f"{folder}/{name}", 2, *args) for name, args in LAYOUTS.items()}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict:
    """1 process with the whole batch, and what each of 2 ranks saw in each layout."""
    root = tmp_path_factory.mktemp("dpo_two")
    return {"one": _trained(str(root / "one"), 1), "ranks": run_distributed(_layouts, 2, str(root))}


@pytest.mark.slow  # two spawned processes, shared by the layouts
@pytest.mark.parametrize("name", LAYOUTS)
def test_two_processes_of_two_microbatches_give_one_process_losses(two_processes, name):
    """Over 10 fp32 steps, 2 ranks x 2 microbatches (unequal pairs each, see below) train and
    validate as 1 process with the whole batch: the loss is the mean over all the pairs, the
    reference stays unchanged and laid out as the model is (FSDP2, HSDP: sharded after each
    of its forwards; TP: split as the model, whose vocabulary-sharded logits give each token's
    log-probability under ``loss_parallel``)."""
    one, ranks = two_processes["one"], two_processes["ranks"]
    two = ranks[0][name]
    assert len(one["losses"]) == len(two["losses"]) == 10
    assert abs(one["losses"][0] - math.log(2)) < 1e-6
    mine, theirs = two["losses"] + two["validation"], one["losses"] + one["validation"]
    assert len(one["validation"]) == 1 and len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert math.isclose(a, b, rel_tol=1e-5), (mine, theirs)
    for rank in ranks:
        assert rank[name]["unchanged"] and rank[name]["laid_out"], name
    placements = set(two["model"])
    if name == "fsdp":  # every parameter sharded, none gathered
        assert placements == {"(Shard(dim=0),)"}, placements
    elif name == "hsdp":  # sharded within each replica
        assert placements == {"(Replicate(), Shard(dim=0))"}, placements
    else:  # split over the tp ranks: weights by rows or columns, the norms replicated
        assert {"(Shard(dim=0),)", "(Shard(dim=1),)", "(Replicate(),)"} <= placements


def test_a_mean_of_per_microbatch_means_would_weigh_the_pairs_otherwise(tmp_path):
    """The first step's rows, split as the 2 x 2 runs split them: unequal pairs per
    microbatch, and, with a policy off the reference, a per-microbatch mean off the mean over
    the pairs."""
    plugin = Dpo()
    split = ("--training.batch_size", "8", "--training.grad_accum_steps", "4")
    trainer = make_trainer(tmp_path, *RUN, *split, plugins=[(NAME, plugin)])
    batch = trainer.batches.next_batch()
    with torch.no_grad():
        trainer.model.norm.weight.mul_(1.5)  # away from the reference
        sums = [plugin(trainer.model, m, i) for i, m in enumerate(batch)]
    units = [int(plugin.units(m)) for m in batch]
    assert len(set(units)) > 1, units
    pair_mean = sum(sums) / sum(units)
    per_microbatch = sum(s / n for s, n in zip(sums, units, strict=True)) / len(units)
    assert abs(pair_mean - per_microbatch) > 1e-4
    trainer.close()


def _lora_references(folder: str) -> dict[str, list[float]]:
    """Train 4 fp32 steps of 2 microbatches with lora, against each reference; the losses.
    adapters_off must build no copy: SetupContext.frozen_copy refuses here."""
    got = {}
    for reference in ("copy", "adapters_off"):
        args = (*RUN, *LORA, "--dpo.reference", reference, "--training.grad_accum_steps", "2")
        with pytest.MonkeyPatch.context() as patch:
            if reference == "adapters_off":
                patch.setattr(SetupContext, "frozen_copy", _no_frozen_copy)
            trainer = make_trainer(Path(folder) / reference, *args, steps=4)
            trainer.run()
        trainer.close()
        got[reference] = losses(Path(folder) / reference)
    return got


@pytest.mark.slow  # two spawned processes
def test_adapters_off_gives_the_copys_losses_under_fsdp2(tmp_path):
    """2 ranks x 2 microbatches with lora: the policy with its adapters off under FSDP2 (no
    second model) gives the sharded copy's losses within 1e-6, step 1's ln 2."""
    for rank in run_distributed(_lora_references, 2, str(tmp_path)):
        copy, off = rank["copy"], rank["adapters_off"]
        assert len(off) == 4 and abs(off[0] - math.log(2)) < 1e-6
        assert abs(off[-1] - math.log(2)) > 1e-4  # the adapters moved the policy
        assert all(abs(a - b) < 1e-6 for a, b in zip(off, copy, strict=True)), (off, copy)


def test_validation_on_held_out_pairs_logs_their_dpo_loss_and_metrics(tmp_path):
    held_out = str(SAMPLE / "preference_validation.jsonl")
    validation = ("--validation.interval", "2", "--validation.steps", "2",
                  "--data.validation_path", held_out)  # fmt: skip
    trainer = make_trainer(tmp_path, *RUN, *validation, steps=2)
    trainer.run()
    (record,) = [r for r in read_metrics(tmp_path) if "validation_loss" in r]
    assert "validation_bpb" not in record
    assert {f"dpo/{m}" for m in METRICS} <= set(record)
    # The mean over the pairs of the validation batches, as the plugin computes each batch's.
    plugin, data = trainer.host.get(NAME), trainer.validation
    with torch.no_grad():
        sums = [
            (plugin(trainer.model, b, i), plugin.units(b)) for i, b in enumerate(data.batches())
        ]
    expected = sum(s for s, _ in sums) / sum(n for _, n in sums)
    assert math.isclose(record["validation_loss"], expected.item(), rel_tol=1e-6)
    assert record["validation_loss"] != pytest.approx(math.log(2), abs=1e-4)  # trained
    trainer.close()


def test_text_validation_data_in_a_dpo_run_is_refused_before_step_one(tmp_path):
    validation = ("--validation.interval", "2", "--data.validation_path",
                  str(SAMPLE / "validation.jsonl"))  # fmt: skip
    # A DataError: a ValueError, as the plugin API does not export it.
    with pytest.raises(ValueError, match="is text data but the training data is preference: "):
        make_trainer(tmp_path, *RUN, *validation)


@pytest.mark.slow  # the debug model at seq_len 256: seconds
def test_the_shipped_config_trains_and_validates_on_the_sample_pairs(tmp_path):
    """configs/dpo_debug.toml as docs/fine-tuning.md runs it, for 2 steps from a fresh start
    (the recipe starts from the chat run's outputs/chat); the test kit's tiny-run arguments
    are set back to the config's."""
    trainer = make_trainer(
        tmp_path, "--config", "dpo_debug",
        *("--data.train_path", "sample:preference_train.jsonl", "--model.flavor", "debug"),
        *("--checkpoint.initial_load_path", "", "--validation.interval", "2"),
        *("--validation.steps", "1", "--training.batch_size", "8", "--training.seq_len", "256"),
        steps=2,
    )  # fmt: skip
    trainer.run()
    records = read_metrics(tmp_path)
    assert abs(records[0]["loss"] - math.log(2)) < 1e-6
    assert "dpo/reward_accuracy" in next(r for r in records if "validation_loss" in r)


@pytest.mark.slow  # three runs: seconds
def test_a_resumed_run_continues_bitwise_with_the_reference_of_its_start(tmp_path):
    """From an initial load (which a resume skips: the model at setup is then the seeded
    init), the stopped and resumed run trains as the straight one: the reference is the
    loaded start's, saved with the checkpoint."""
    base = make_trainer(tmp_path / "base", "--checkpoint.save_final", "true", steps=2)
    base.run()
    start = ("--checkpoint.initial_load_path", str(tmp_path / "base"))
    result = interrupted_and_resumed(
        tmp_path / "dpo", *RUN, *start, steps=4, stop_after=2, plugins=lambda: [(NAME, Dpo())]
    )
    assert result["step_at_resume"] == 2
    straight = [r["loss"] for r in result["straight_metrics"] if "loss" in r]
    resumed = [r["loss"] for r in result["resumed_metrics"] if "loss" in r]
    assert resumed == straight and result["resumed"] == result["straight"]
