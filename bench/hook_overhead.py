"""What plugtrain's hooks cost: its training step against a hand-written loop doing the same work.

A is ``Trainer.train_step`` with the ``grad_clip`` and ``grad_scaler`` plugins enabled. B is a
loop written out by hand: the same model built the same way (meta device, FSDP2 ``fully_shard``
per block and at the root, ``init_weights`` with the same seed), the same AdamW and LR
schedule, the same clipping (``torch.nn.utils.get_total_norm`` + ``clip_grads_with_norm_``)
and, in float16, the same ``torch.amp.GradScaler`` calls in the canonical order (scale,
backward, unscale_, clip, step, update). C is a second, identical hand-written loop: the
control. All three train on the same fixed batch, in one process, taking turns in rounds
(A B C, C B A, ...); each round gives a ratio A/B, plugtrain's cost, and a ratio C/B, which
is 1 but for the machine's noise: how far C/B strays from 1 is how far a ratio can stray by
chance (the method's noise floor, reported next to the result).

Two cases: the CPU debug model in bfloat16 (the scaler deactivates itself; target: A within
1% of B) and the tiny model in float16 with the scaler active (target: within 2%; float16
matmuls are ~20x slower than bfloat16 on CPUs, hence the tiny model). As a check that A, B and
C really do the same work, the losses of their steps are compared: they are bitwise equal.

``--same-model`` makes B and C step A's own model, optimizer and schedule instead of models
of their own: then A/B compares the two code paths on the very same tensors, free of any
difference between separately allocated models (their losses, sharing one state, are not
compared).

    python bench/hook_overhead.py        # about a minute and a half
    python bench/hook_overhead.py --quick
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import benchlib
import torch
from torch.distributed.tensor import DTensor

from plugtrain.model import cross_entropy
from plugtrain.model.sharding import build_model
from plugtrain.training.launch import configure
from plugtrain.training.optim import LRSchedule, build_optimizer
from plugtrain.training.trainer import StepBatch, Trainer

NAME = "hook_overhead"
PLUGINS = ["grad_clip", "grad_scaler"]
MAX_NORM = 1.0
NORM_TYPE = 2.0


@dataclass(frozen=True)
class Case:
    """One comparison: a model, a dtype, a batch, and the target for the median ratio A/B."""

    name: str
    flavor: str
    dtype: str
    batch_size: int
    seq_len: int
    rounds: int
    """Rounds of one step of each of A, B and C (the default of ``--rounds``)."""
    target: float
    """The largest acceptable median ratio A/B, e.g. 1.01."""


CASES = [
    Case("debug-bf16", "debug", "bfloat16", batch_size=8, seq_len=128, rounds=40, target=1.01),
    Case("tiny-fp16", "tiny", "float16", batch_size=8, seq_len=64, rounds=80, target=1.02),
]


class HandWrittenLoop:
    """Loop B: the step a user would write without plugtrain, on a model built like A's.

    With ``same_model``, it steps the trainer's own model, optimizer and LR schedule instead of
    building its own: the same code on the same tensors as A, so that A/B is the cost of the
    code path alone, free of any difference between two separately allocated models.
    """

    def __init__(self, trainer: Trainer, same_model: bool = False) -> None:
        cfg, device = trainer.config, trainer.device
        self.device = device
        if same_model:
            self.model, self.optimizer = trainer.model, trainer.optimizer
            self.lr_scheduler = trainer.lr_scheduler
        else:
            self.model = build_model(
                trainer.model_spec,
                trainer.model_args,
                trainer.parallel_dims.get_mesh("dp"),
                trainer.param_dtype,
                trainer.reduce_dtype,
                device,
                cfg.training.seed,
            )
            self.optimizer = build_optimizer(self.model, cfg.optimizer, device)
            self.lr_scheduler = LRSchedule(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.params = list(self.model.parameters())
        self.applied = torch.ones((), dtype=torch.bool, device=device)
        self.scaler = (
            torch.amp.GradScaler(device.type, init_scale=cfg.plugin("grad_scaler").init_scale)
            if trainer.param_dtype == torch.float16
            else None
        )

    def train_step(self, batch: StepBatch) -> torch.Tensor:
        """Forward and backward each microbatch, unscale, clip, step, update; the mean loss."""
        scaler = self.scaler
        loss_sum = torch.zeros((), device=self.device)
        for inputs, targets, *_ in batch:
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            loss = cross_entropy(self.model(inputs), targets) / len(batch)
            loss_sum += loss.detach()
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        params = [p for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], NORM_TYPE, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm, foreach=True)
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        # NOTE: stepped even when the scaler skipped the optimizer step (plugtrain does not):
        # the canonical loop. No step is skipped in the timed region (see "skipped" in the JSON).
        self.lr_scheduler.step(self.applied)
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum


def timed(
    step: Callable[[StepBatch], torch.Tensor], batch: StepBatch
) -> tuple[float, float, float]:
    """Run one step; return its wall time and its CPU time in seconds, and its loss.

    NOTE: CPU time (of every thread of the process) counts the work the step did and leaves
    out the time the process waited for a core that other processes held. On a shared machine
    it is the steadier measure of what the hooks cost; wall time is what a user waits.
    """
    start, start_cpu = time.perf_counter(), time.process_time()
    loss = step(batch)
    # NOTE: reading the loss waits for the device (CUDA); on the CPU everything is already done.
    value = loss.item()
    return time.perf_counter() - start, time.process_time() - start_cpu, value


def run_case(
    case: Case,
    n_rounds: int,
    warmup: int,
    accum: int,
    control: bool = True,
    same_model: bool = False,
) -> dict:
    """Build A, B and (if ``control``) C for ``case``, run their steps in turns, and compare.

    With ``same_model``, B and C step A's model (see :class:`HandWrittenLoop`); the three then
    share one training state, so their losses are not compared.
    """
    train_args = benchlib.trainer_args(
        case.flavor,
        case.dtype,
        "--plugins.enabled", ",".join(PLUGINS),
        "--grad_clip.max_norm", str(MAX_NORM),
        "--grad_clip.norm_type", str(NORM_TYPE),
        "--training.grad_accum_steps", str(accum),
        "--training.steps", str(warmup + n_rounds + 1),
        batch_size=case.batch_size,
        seq_len=case.seq_len,
    )  # fmt: skip
    config, host = configure(train_args)
    trainer = Trainer(config, host)
    hands = [HandWrittenLoop(trainer, same_model) for _ in range(2 if control else 1)]
    batch = trainer.batches.next_batch()
    steps: list[Callable[[StepBatch], torch.Tensor]] = [
        lambda b: trainer.train_step(b)[0],
        *(hand.train_step for hand in hands),
    ]
    losses: list[list[float]] = [[] for _ in steps]
    for _ in range(warmup):
        for i, step in enumerate(steps):
            losses[i].append(timed(step, batch)[2])
    skipped_before = [int(trainer.vetoes.total), *map(_skipped, hands)]
    wall: list[list[float]] = [[] for _ in steps]
    cpu: list[list[float]] = [[] for _ in steps]
    for i in benchlib.rounds(n_rounds, len(steps)):
        seconds, cpu_seconds, loss = timed(steps[i], batch)
        wall[i].append(seconds)
        cpu[i].append(cpu_seconds)
        losses[i].append(loss)
    skipped = [int(trainer.vetoes.total), *map(_skipped, hands)]
    return {
        "case": case.name,
        "flavor": case.flavor,
        "dtype": case.dtype,
        "batch_size": case.batch_size,
        "seq_len": case.seq_len,
        "grad_accum_steps": accum,
        "plugins_enabled": PLUGINS,
        "plugins_active": trainer.host.names(),
        "warmup_steps": warmup,
        "rounds": n_rounds,
        "same_model": same_model,
        "target_ratio": case.target,
        "losses_bitwise_equal": None if same_model else all(run == losses[0] for run in losses),
        "skipped_in_timed_steps": {
            name: after - before
            for name, after, before in zip(
                ("plugtrain", "hand_written", "control"), skipped, skipped_before, strict=False
            )
        },
        "wall": compare(wall, case.target),
        "cpu": compare(cpu, case.target),
    }


def compare(times: list[list[float]], target: float) -> dict:
    """The paired ratios A/B and, as ``control``, C/B of ``times`` [A, B(, C)]; the verdict.

    Met: the median ratio A/B is within the target. Proven: so is the upper end of its 95% CI.
    """
    a, b, *c = times
    result = benchlib.paired_ratio(a, b)
    if c:
        result["control"] = benchlib.paired_ratio(c[0], b)
    result["target_met"] = result["ratio"]["median"] <= target
    result["target_proven"] = result["ratio_ci95"][1] <= target
    return result


def _skipped(hand: HandWrittenLoop) -> int:
    """Optimizer steps the hand-written loop's scaler skipped so far (AdamW counts its steps)."""
    state = next(iter(hand.optimizer.state.values()), None)
    taken = int(state["step"]) if state else 0
    return int(hand.lr_scheduler.applied_steps) - taken


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cases",
        default=",".join(c.name for c in CASES),
        help="comma-separated, of: %(default)s",
    )
    parser.add_argument("--rounds", type=int, help="rounds of A, B, C per case (default: per case)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    parser.add_argument("--accum", type=int, default=1, help="training.grad_accum_steps")
    parser.add_argument(
        "--same-model",
        action="store_true",
        help="B and C step A's own model: the code path's cost alone (losses not compared)",
    )


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0], add_args)
    by_name = {c.name: c for c in CASES}
    results, rows = [], []
    for name in args.cases.split(","):
        if name not in by_name:
            raise SystemExit(f"unknown case '{name}': choose from {', '.join(by_name)}")
        case = by_name[name]
        if args.quick:
            # Checks that the bench runs, not what it measures: the tiny model, whatever the case.
            case = replace(case, flavor="tiny", batch_size=4, seq_len=32)
        n_rounds = 3 if args.quick else (args.rounds or case.rounds)
        print(f"{case.name}: {case.flavor} model, {case.dtype}, {n_rounds} rounds ...")
        r = run_case(
            case, n_rounds, 1 if args.quick else args.warmup, args.accum, True, args.same_model
        )
        results.append(r)
        for measure in ("cpu", "wall"):
            m = r[measure]
            rows.append([
                r["case"], ",".join(r["plugins_active"]), measure, r["rounds"],
                f"{m['b_seconds']['median'] * 1e3:.1f}", f"{m['a_seconds']['median'] * 1e3:.1f}",
                ratio_cell(m), ratio_cell(m["control"]), f"{case.target:.2f}",
                "proven" if m["target_proven"] else ("yes" if m["target_met"] else "NO"),
                r["losses_bitwise_equal"],
            ])  # fmt: skip
    print(
        "\nA = plugtrain, B = hand-written loop, C = a second hand-written loop (control);"
        " ratios: median (95% CI) [IQR]\n"
    )
    print(
        benchlib.table(
            [
                "case",
                "active plugins",
                "time",
                "rounds",
                "B ms",
                "A ms",
                "A/B",
                "control C/B",
                "target",
                "met",
                "same losses",
            ],
            rows,
        )
    )
    benchlib.write_json(args.out, NAME, args, {"cases": results})


def ratio_cell(result: dict) -> str:
    """``median (CI low-high) [q1-q3]`` of a paired ratio."""
    ratio, (lo, hi) = result["ratio"], result["ratio_ci95"]
    return f"{ratio['median']:.4f} ({lo:.4f}-{hi:.4f}) [{ratio['q1']:.3f}-{ratio['q3']:.3f}]"


if __name__ == "__main__":
    main()
