"""What downstream evaluation costs and says on the default run: time per 100 items, its share
of the run, and the debug model's accuracy on the shipped cloze before and after training.

The default run (``python train.py``: the debug model, 200 steps, validation every 50) with the
``downstream_eval`` plugin at its defaults (the shipped cloze, 100 items per validation), built
in this process: before step 1 and after step 200 all 400 items are scored with the same
scorer (``plugtrain.evaluation.score``), timed, with a 95% Wilson interval; the plugin's time in
the run comes from the hook trace (``metrics.trace_hooks``). The run's [step, loss,
validation_loss, lr] sha256 is printed: equal to the default run's, the plugin changed no
training number.

    python bench/downstream_eval.py        # the whole default run: minutes on 2 CPU cores
    python bench/downstream_eval.py --quick   # 20 steps
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path

import benchlib

from plugtrain.evaluation import encode_tasks, read_task, score, wilson_interval
from plugtrain.training import Trainer, configure

NAME = "downstream_eval"


def sha256_of_run(folder: Path) -> str:
    """The default run's check: sha256 of [step, loss, validation_loss, lr] of every record."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    keys = ("step", "loss", "validation_loss", "lr")
    return hashlib.sha256(
        json.dumps([[r.get(k) for k in keys] for r in records]).encode()
    ).hexdigest()


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0])
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "run"
        argv = ["--job.dump_folder", str(folder), "--plugins.enabled", NAME,
                "--metrics.trace_hooks", "true", "--checkpoint.save_final", "false"]  # fmt: skip
        if args.quick:
            argv += ["--training.steps", "20", "--validation.interval", "10"]
        configured = configure(argv)
        assert configured is not None
        trainer = Trainer(*configured)
        task = read_task("sample:cloze.jsonl")
        every_item = encode_tasks(
            [task], trainer.tokenizer, trainer.model_args.max_seq_len, max_items=0
        )
        results = {}

        def scored(when: str) -> None:
            start = time.perf_counter()
            result = score(trainer.model, every_item)["cloze"]
            seconds = time.perf_counter() - start
            low, high = wilson_interval(result.correct, result.items)
            results[when] = {
                "items": result.items,
                "acc": result.acc,
                "acc_95": [low, high],
                "acc_norm": result.acc_norm,
                "acc_norm_95": list(wilson_interval(result.correct_norm, result.items)),
                "seconds_per_100_items": seconds * 100 / result.items,
            }

        scored(f"step {trainer.step}")
        start = time.perf_counter()
        trainer.run()
        run_seconds = time.perf_counter() - start
        scored(f"step {trainer.step}")
        trace = json.loads((folder / "hook_trace.rank0.jsonl").read_text().splitlines()[-1])
        plugin_ms = sum(h["ms"] for h in trace["summary"]["plugins"][NAME].values())
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        results["run"] = {
            "seconds": run_seconds,
            "plugin_seconds": plugin_ms / 1e3,
            "plugin_share": plugin_ms / 1e3 / run_seconds,
            "sha256": sha256_of_run(folder),
            "logged": {
                r["step"]: r[f"{NAME}/cloze/acc"] for r in records if f"{NAME}/cloze/acc" in r
            },
        }
    rows = [
        (when, r["items"], r["acc"], f"{r['acc_95'][0]:.3f}-{r['acc_95'][1]:.3f}", r["acc_norm"],
         r["seconds_per_100_items"])
        for when, r in results.items() if when != "run"
    ]  # fmt: skip
    print(benchlib.table(["model", "items", "acc", "acc 95%", "acc_norm", "s / 100 items"], rows))
    print(json.dumps(results["run"], indent=2))
    benchlib.write_json(args.out, NAME, args, results)


if __name__ == "__main__":
    main()
