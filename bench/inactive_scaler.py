"""The grad_scaler plugin costs nothing when inactive: profiler op counts of a step, compared.

For bfloat16 and float32 (where ``grad_scaler`` with ``enabled = "auto"`` deactivates itself),
each rank of a 2-process FSDP2 run (gloo) builds two trainers, one with ``grad_clip`` only and
one with ``grad_clip`` and ``grad_scaler``, and records every operator of a few steps of each
with ``torch.profiler``. The op counts must be identical: zero
``aten::_amp_foreach_non_finite_check_and_unscale_``, no extra collective, no extra ``.item()``.
The parameters after those steps must be bitwise equal too.

A float16 control runs the same comparison with the scaler active, to show that the method
sees the scaler when it works: there the counts differ by its inf checks and its all-reduce.

    python bench/inactive_scaler.py       # about half a minute
    python bench/inactive_scaler.py --quick
"""

from __future__ import annotations

import argparse
import warnings
from collections import Counter

import benchlib
import torch
from torch.profiler import ProfilerActivity, profile

from plugtrain.testing import run_distributed

NAME = "inactive_scaler"
INF_CHECK = "aten::_amp_foreach_non_finite_check_and_unscale_"
BACKEND_COLLECTIVES = ("gloo:", "nccl:")
"""Events of the process group's backend: one per collective that really runs (the c10d and
functional-collective layers above it record the same collective again under other names)."""
SYNC = "aten::item"
WITHOUT, WITH = ["grad_clip"], ["grad_clip", "grad_scaler"]


def profile_steps(
    flavor: str, dtype: str, plugins: list[str], steps: int
) -> tuple[Counter, list[str], list[torch.Tensor]]:
    """Op counts over ``steps`` profiled steps (after one unprofiled), the active plugins, and
    the full parameters afterwards."""
    from plugtrain.training.launch import configure
    from plugtrain.training.trainer import Trainer

    train_args = benchlib.trainer_args(
        flavor, dtype, "--plugins.enabled", ",".join(plugins), batch_size=8, seq_len=64
    )
    trainer = Trainer(*configure(train_args))
    trainer.train_step(trainer.batches.next_batch())  # lazy initialisations, outside the profile
    batches = [trainer.batches.next_batch() for _ in range(steps)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches:
            trainer.train_step(batch)
    counts = Counter({e.key: e.count for e in prof.key_averages()})
    params = [p.detach().full_tensor() for p in trainer.model.parameters()]
    return counts, trainer.host.names(), params


def worker(flavor: str, dtypes: list[str], steps: int, threads: int) -> list[dict]:
    """One rank: for each dtype, profile the step without and with the scaler, and compare."""
    torch.set_num_threads(threads)
    # NOTE: the float16 control's run without the scaler rightly warns that nothing scales the
    # loss; that is the point of the control, so the warning is not repeated here.
    warnings.filterwarnings("ignore", message=".*no enabled plugin scales the loss")
    out = []
    for dtype in dtypes:
        without, active_without, params_without = profile_steps(flavor, dtype, WITHOUT, steps)
        with_, active_with, params_with = profile_steps(flavor, dtype, WITH, steps)
        differing = {
            key: [without[key], with_[key]]
            for key in sorted(without.keys() | with_.keys())
            if without[key] != with_[key]
        }
        out.append(
            {
                "dtype": dtype,
                "steps_profiled": steps,
                "active_plugins": {"without": active_without, "with": active_with},
                "ops_total": {"without": without.total(), "with": with_.total()},
                "distinct_ops": {"without": len(without), "with": len(with_)},
                "inf_checks": {"without": without[INF_CHECK], "with": with_[INF_CHECK]},
                "collectives": {
                    "without": _collectives(without),
                    "with": _collectives(with_),
                },
                "item_calls": {"without": without[SYNC], "with": with_[SYNC]},
                "differing_ops": differing,
                "identical": not differing,
                "params_bitwise_equal": all(
                    torch.equal(a, b) for a, b in zip(params_without, params_with, strict=True)
                ),
            }
        )
    return out


def _collectives(counts: Counter) -> int:
    return sum(n for key, n in counts.items() if key.startswith(BACKEND_COLLECTIVES))


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flavor", default="tiny", help="model flavour (default: %(default)s)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per trainer")
    parser.add_argument(
        "--dtypes",
        default="bfloat16,float32,float16",
        help="float16 is the control, where the scaler is active (default: %(default)s)",
    )


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0], add_args)
    if args.quick:
        args.steps, args.dtypes = 1, "bfloat16,float16"
    dtypes = args.dtypes.split(",")
    per_rank = run_distributed(worker, args.nproc, args.flavor, dtypes, args.steps, args.threads)
    rows = []
    for rank, results in enumerate(per_rank):
        for r in results:
            rows.append([
                rank, r["dtype"], ",".join(r["active_plugins"]["with"]),
                *(f"{r[k]['without']} / {r[k]['with']}"
                  for k in ("ops_total", "inf_checks", "collectives", "item_calls")),
                "yes" if r["identical"] else f"NO ({len(r['differing_ops'])} ops differ)",
                r["params_bitwise_equal"],
            ])  # fmt: skip
    print(
        f"\n{args.flavor} model, {args.nproc} processes, {args.steps} profiled step(s); "
        "each cell: grad_clip alone / grad_clip + grad_scaler\n"
    )
    print(
        benchlib.table(
            [
                "rank",
                "dtype",
                "active with scaler enabled",
                "ops",
                "inf checks",
                "collectives",
                "aten::item",
                "identical",
                "same params",
            ],
            rows,
        )
    )
    for r in per_rank[0]:
        if r["differing_ops"]:
            print(f"\n{r['dtype']}, rank 0, ops whose counts differ (without, with):")
            for key, (a, b) in r["differing_ops"].items():
                print(f"  {key}: {a} -> {b}")
    benchlib.write_json(
        args.out,
        NAME,
        args,
        {
            "flavor": args.flavor,
            "processes": args.nproc,
            "ranks": [{"rank": rank, "dtypes": r} for rank, r in enumerate(per_rank)],
        },
    )


if __name__ == "__main__":
    main()
