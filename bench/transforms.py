"""The model transforms and a single process: activation checkpointing, compile, world size 1.

1. Activation checkpointing (the ``activation_checkpointing`` plugin, applied through its
   ``wrap_model`` hook): peak memory of one forward and backward (``plugtrain.testing.PeakMemory``:
   the bytes of the tensors the step creates, alive at once), forward+backward time against
   the same model without it (alternated, ratio per pair), and whether loss and gradients are
   bitwise equal, for each mode, on the debug flavour and a larger CPU model, fp32.
2. World size 1: ``Trainer.train_step`` with ``grad_clip`` (A) against a plain
   nanoGPT-style loop (B: the same ``Transformer``, ``init_weights``, fused AdamW, LR schedule
   and clipping; no FSDP2, ``torch.autocast`` in bf16), with a second plain loop as the control
   (C), and, as D, the plain loop over the same model sharded by FSDP2 ``fully_shard`` at world
   size 1 (what plugtrain did in fp32 before it skipped sharding there). Debug model, fp32 and
   bf16, one process, alternated rounds, CPU time. Target: B/A >= 0.98 (A/B <= 1.02).
3. Compile (the ``compile`` plugin, inductor: blocks and loss path): plugtrain's step compiled
   against the same step eager, on the debug model in fp32, after warm-up; the time of the
   first (compiling) step; the largest relative difference of the losses over the timed steps.
   Not bf16: these CPUs have no native bf16 (a bf16 matmul is ~15x slower than fp32), so its
   speed on CPU says nothing about a GPU's (``bench/gpu.py`` measures it).

    python bench/transforms.py             # several minutes on one thread
    python bench/transforms.py --quick     # seconds: tiny model, aot_eager (fp32), 3 rounds
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import benchlib
import torch
from hook_overhead import timed
from plugtrain_activation_checkpointing import ActivationCheckpointing

from plugtrain.model import cross_entropy
from plugtrain.model.llama.transformer import FLAVORS, ModelArgs, Transformer
from plugtrain.testing import PeakMemory, model_context
from plugtrain.training.launch import configure
from plugtrain.training.optim import LRSchedule, build_optimizer
from plugtrain.training.trainer import StepBatch, Trainer

NAME = "transforms"
AC_MODES: dict[str, tuple[str, ...]] = {
    "full": (),
    "selective-op": ("--activation_checkpointing.mode", "selective"),
    "selective-layer": (
        "--activation_checkpointing.mode", "selective",
        "--activation_checkpointing.selective_by", "layer",
    ),
}  # fmt: skip
LARGER = dataclasses.replace(FLAVORS["debug"], dim=512, n_layers=8, n_heads=8, n_kv_heads=4)
"""The larger CPU model of the activation checkpointing part (~25M parameters)."""
WS1_TARGET = 1.02


# --------------------------------------------------------------------------- 1. checkpointing


def ac_model(args: ModelArgs, mode: str | None) -> tuple[torch.nn.Module, list[int]]:
    """A plain model (seed 0) with the plugin's ``wrap_model`` applied in ``mode`` (None: not)."""
    model = Transformer(args)
    model.init_weights(seed=0)
    plugin = ActivationCheckpointing()
    if mode is not None:
        enable = ("--plugins.enabled", "activation_checkpointing", *AC_MODES[mode])
        plugin.wrap_model(model_context({"activation_checkpointing": plugin}, *enable, model=model))
    return model, plugin.checkpointed_blocks


def forward_backward(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return loss.detach()


def activation_checkpointing(name: str, args: ModelArgs, batch: int, seq: int, rounds: int) -> dict:
    tokens = torch.randint(
        0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0)
    )
    plain, _ = ac_model(args, None)
    with PeakMemory() as memory:
        plain_loss = forward_backward(plain, tokens)
    plain_grads = [p.grad.clone() for p in plain.parameters()]
    result: dict[str, Any] = {
        "model": name,
        "params": args.num_params(),
        "batch": batch,
        "seq_len": seq,
        "none_peak_mib": memory.peak / 2**20,
        "modes": [],
    }
    for mode in AC_MODES:
        model, blocks = ac_model(args, mode)
        with PeakMemory() as memory:
            loss = forward_backward(model, tokens)
        equal = torch.equal(loss, plain_loss) and all(
            torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain_grads, strict=True)
        )
        times: list[list[float]] = [[], []]
        for i in benchlib.rounds(rounds, 2):
            m = (model, plain)[i]
            m.zero_grad(set_to_none=True)
            start = time.process_time()
            forward_backward(m, tokens)
            times[i].append(time.process_time() - start)
        result["modes"].append(
            {
                "mode": mode,
                "checkpointed_blocks": blocks,
                "peak_mib": memory.peak / 2**20,
                "peak_ratio": memory.peak / result["none_peak_mib"] / 2**20,
                "bitwise_equal": equal,
                "time": benchlib.paired_ratio(*times),
            }
        )
    return result


# --------------------------------------------------------------------------- 2. world size 1


class PlainLoop:
    """A nanoGPT-style loop: the model as is (or sharded by FSDP2, ``fsdp``), fused AdamW, the
    LR schedule, clipping to 1.0; bf16 through ``torch.autocast``."""

    def __init__(self, trainer: Trainer, fsdp: bool = False) -> None:
        cfg = trainer.config
        with torch.device("meta" if fsdp else "cpu"):
            self.model = Transformer(trainer.model_args)
        if fsdp:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(trainer.param_dtype, trainer.reduce_dtype)
            for block in self.model.layers.values():
                fully_shard(block, mesh=trainer.parallel_dims.get_mesh("dp"), mp_policy=policy)
            fully_shard(self.model, mesh=trainer.parallel_dims.get_mesh("dp"), mp_policy=policy)
            self.model.to_empty(device="cpu")
        self.model.init_weights(cfg.training.seed)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, trainer.device)
        self.lr_scheduler = LRSchedule(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.params = list(self.model.parameters())
        self.autocast = (
            trainer.param_dtype if not fsdp and trainer.param_dtype != torch.float32 else None
        )
        self.applied = torch.ones((), dtype=torch.bool)

    def train_step(self, batch: StepBatch) -> torch.Tensor:
        loss_sum = torch.zeros(())
        for inputs, targets, *_ in batch:
            with torch.autocast(
                "cpu", self.autocast or torch.float32, enabled=self.autocast is not None
            ):
                logits = self.model(inputs)
            loss = cross_entropy(logits, targets) / len(batch)
            loss_sum += loss.detach()
            loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.params], 2.0, foreach=True)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(self.params, 1.0, norm, foreach=True)
        self.optimizer.step()
        self.lr_scheduler.step(self.applied)
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum


def world_size_one(flavor: str, dtype: str, batch: int, seq: int, rounds: int, warmup: int) -> dict:
    train_args = benchlib.trainer_args(
        flavor,
        dtype,
        "--plugins.enabled",
        "grad_clip",
        "--grad_clip.max_norm",
        "1.0",
        "--training.steps",
        str(warmup + rounds + 1),
        batch_size=batch,
        seq_len=seq,
    )
    trainer = Trainer(*configure(train_args))
    plain, control, fsdp = PlainLoop(trainer), PlainLoop(trainer), PlainLoop(trainer, fsdp=True)
    batch_ = trainer.batches.next_batch()
    steps: list[Callable[[StepBatch], torch.Tensor]] = [
        lambda b: trainer.train_step(b)[0],
        plain.train_step,
        control.train_step,
        fsdp.train_step,
    ]
    losses: list[list[float]] = [[] for _ in steps]
    for _ in range(warmup):
        for i, step in enumerate(steps):
            losses[i].append(timed(step, batch_)[2])
    cpu: list[list[float]] = [[] for _ in steps]
    for i in benchlib.rounds(rounds, len(steps)):
        _, seconds, loss = timed(steps[i], batch_)
        cpu[i].append(seconds)
        losses[i].append(loss)
    trainer.close()
    a, b, c, d = cpu
    vs_plain = benchlib.paired_ratio(a, b)
    return {
        "flavor": flavor,
        "dtype": dtype,
        "batch": batch,
        "seq_len": seq,
        "rounds": rounds,
        "sharded": any(hasattr(p, "full_tensor") for p in trainer.model.parameters()),
        "plugtrain_vs_plain": vs_plain,
        "control_vs_plain": benchlib.paired_ratio(c, b),
        "fsdp_vs_plain": benchlib.paired_ratio(d, b),
        "losses_equal_plain": losses[0] == losses[1],
        "target_met": vs_plain["ratio"]["median"] <= WS1_TARGET,
    }


# --------------------------------------------------------------------------- 3. compile


def compiled_vs_eager(
    flavor: str, dtype: str, backend: str, batch: int, seq: int, rounds: int, warmup: int
) -> dict:
    def trainer(compile_: bool) -> Trainer:
        extra = ["--compile.backend", backend] if compile_ else []
        train_args = benchlib.trainer_args(
            flavor, dtype, "--plugins.enabled", "grad_clip,compile" if compile_ else "grad_clip",
            *extra, "--training.steps", str(warmup + rounds + 2),
            "--job.dump_folder", str(benchlib.REPO / "outputs" / "bench" / f"run-{compile_}"),
            batch_size=batch, seq_len=seq,
        )  # fmt: skip
        return Trainer(*configure(train_args))

    torch._dynamo.reset()
    eager, compiled = trainer(False), trainer(True)
    batch_ = eager.batches.next_batch()
    steps = [lambda b: eager.train_step(b)[0], lambda b: compiled.train_step(b)[0]]
    first = [timed(step, batch_) for step in steps]  # the compiled one compiles here
    for _ in range(warmup):
        for step in steps:
            timed(step, batch_)
    cpu: list[list[float]] = [[], []]
    losses: list[list[float]] = [[], []]
    for i in benchlib.rounds(rounds, 2):
        _, seconds, loss = timed(steps[i], batch_)
        cpu[i].append(seconds)
        losses[i].append(loss)
    eager.close()
    compiled.close()
    diff = max(abs(x - y) / abs(y) for x, y in zip(losses[1], losses[0], strict=True))
    speed = benchlib.paired_ratio(cpu[0], cpu[1])  # eager / compiled: > 1 means faster
    return {
        "flavor": flavor,
        "dtype": dtype,
        "backend": backend,
        "batch": batch,
        "seq_len": seq,
        "rounds": rounds,
        "first_step_seconds": {"eager": first[0][0], "compiled": first[1][0]},
        "compile_seconds": first[1][0] - first[0][0],
        "eager_over_compiled": speed,
        "max_loss_rel_diff": diff,
    }


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--parts", default="ac,ws1,compile", help="comma-separated, of: %(default)s"
    )
    parser.add_argument("--rounds", type=int, default=20, help="alternated rounds per comparison")


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0], add_args)
    quick, parts, rounds = args.quick, args.parts.split(","), 3 if args.quick else args.rounds
    results: dict[str, Any] = {}
    if "ac" in parts:
        models = (
            [("tiny", FLAVORS["tiny"], 4, 32)]
            if quick
            else [("debug", FLAVORS["debug"], 8, 128), ("larger", LARGER, 8, 256)]
        )
        results["activation_checkpointing"] = ac = [
            activation_checkpointing(*m, rounds=rounds) for m in models
        ]
        print(
            benchlib.table(
                ["model", "mode", "blocks", "MiB none", "MiB", "ratio", "time ratio", "bitwise"],
                [
                    [
                        r["model"],
                        m["mode"],
                        len(m["checkpointed_blocks"]),
                        f"{r['none_peak_mib']:.1f}",
                        f"{m['peak_mib']:.1f}",
                        f"{m['peak_ratio']:.2f}",
                        f"{m['time']['ratio']['median']:.3f}",
                        m["bitwise_equal"],
                    ]
                    for r in ac
                    for m in r["modes"]
                ],
            )
        )
    if "ws1" in parts:
        flavor, batch, seq = ("tiny", 4, 32) if quick else ("debug", 8, 128)
        results["world_size_1"] = ws1 = [
            world_size_one(flavor, dtype, batch, seq, rounds, 1 if quick else 3)
            for dtype in ("float32", "bfloat16")
        ]
        print(
            benchlib.table(
                ["flavor", "dtype", "sharded", "A/B", "C/B control", "D/B fsdp", "met"],
                [
                    [
                        r["flavor"],
                        r["dtype"],
                        r["sharded"],
                        f"{r['plugtrain_vs_plain']['ratio']['median']:.3f}",
                        f"{r['control_vs_plain']['ratio']['median']:.3f}",
                        f"{r['fsdp_vs_plain']['ratio']['median']:.3f}",
                        r["target_met"],
                    ]
                    for r in ws1
                ],
            )
        )
    if "compile" in parts:
        backend, flavor, batch, seq = (
            ("aot_eager", "tiny", 4, 32) if quick else ("inductor", "debug", 8, 128)
        )
        results["compile"] = comp = [
            compiled_vs_eager(flavor, dtype, backend, batch, seq, rounds, 1 if quick else 3)
            for dtype in ("float32",)
        ]
        print(
            benchlib.table(
                [
                    "flavor",
                    "dtype",
                    "backend",
                    "rounds",
                    "compile s",
                    "eager/compiled",
                    "95% CI",
                    "max loss rel diff",
                ],
                [
                    [
                        r["flavor"],
                        r["dtype"],
                        r["backend"],
                        r["rounds"],
                        f"{r['compile_seconds']:.1f}",
                        f"{r['eager_over_compiled']['ratio']['median']:.3f}",
                        "[{:.3f}, {:.3f}]".format(*r["eager_over_compiled"]["ratio_ci95"]),
                        f"{r['max_loss_rel_diff']:.2e}",
                    ]
                    for r in comp
                ],
            )
        )
    benchlib.write_json(args.out, NAME, args, results)


if __name__ == "__main__":
    main()
