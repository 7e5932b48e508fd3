"""Chaos soak: random kills of a 2-process torchrun run, which must end bit for bit where it would.

A tiny fp32 model trains on 2 CPU processes (gloo) under ``torchrun --max-restarts`` with a c10d
rendezvous on the loopback address, with checkpoints every ``--interval`` steps and grad_clip,
ema and spike_guard enabled; two ranges of poisoned batches (``PoisonBatches``) make it skip and
rewind twice. A killer sends SIGKILL to a random worker at seeded moments (``--kills``):

* ``save``: while a checkpoint is written (as soon as a ``step-N.partial`` folder shows);
* ``between``: after a completed step, while no checkpoint is being written;
* ``rewind``: while a rewind loads its checkpoint (the moment is too short to hit from outside
  on a tiny model: the chosen worker kills itself in ``checkpoint_loaded`` when
  ``data_skips.json`` says a rewind is under way, once per rewind);

plus one preemption: SIGTERM to torchrun (the workers save and stop), then the same command
again. The same run uninterrupted is the reference; the verdict asks that the final
checkpoints be bitwise equal (parameters, optimizer state, EMA weights, every other tensor),
``metrics.jsonl`` hold each step once, in order, with the reference's losses, no ``.partial``
folder be left, at most ``keep_latest_k`` checkpoints be kept and ``data_skips.json`` be the
same. No loss scale is compared: the run is fp32, where grad_scaler does nothing; fp16 would
be 15-20x slower on these CPUs, and the scaler's resume is tested on its own.

    python bench/chaos.py                       # 20 kills in each checkpoint mode, minutes
    python bench/chaos.py --quick               # 3 kills and a preemption, async mode only
    python bench/chaos.py --seed 7 --modes async   # replay one schedule
    python bench/chaos.py --store s3 --kills 5 --modes async   # checkpoints on S3

With ``--store s3`` the checkpoints go to a real S3 server on 127.0.0.1 (moto's, started here:
``plugtrain.testing.S3Server``), the metrics and records stay in the local folder; a "save"
kill aims at a checkpoint prefix without its marker, and the verdict asks that no unmarked
prefix be left.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import benchlib

from plugtrain.plugin import hookimpl

KEEP = 3
POISONED = ({9, 10, 11}, {21, 22, 23})
"""Two ranges of poisoned batches: each makes spike_guard skip 2 steps in a row and rewind."""
REWIND_ARMS = "chaos_rewind_arms.json"
"""In the dump folder: which rank kills itself during which rewind (by rewind number)."""
POLL_S = 0.005
AIM_S = 0.001
"""Polling periods: of the run's progress, and of the checkpoint folder when aiming at a save."""


def run_args(mode: str, interval: int) -> list[str]:
    """The training arguments of a soak run, after the kit's tiny run's (``tiny_args``)."""
    return [
        "--plugins.enabled", "grad_clip,ema,spike_guard",
        "--ema.decay", "0.9",
        "--spike_guard.window", "4", "--spike_guard.warmup_steps", "3",
        "--spike_guard.sigma", "6", "--spike_guard.signals", "grad_norm",
        "--spike_guard.max_consecutive", "2", "--spike_guard.rewind_min_steps", "1",
        "--spike_guard.skip_margin", "1", "--spike_guard.max_rewinds", "4",
        "--checkpoint.enable", "true", "--checkpoint.interval", str(interval),
        "--checkpoint.keep_latest_k", str(KEEP), "--checkpoint.async_mode", mode,
    ]  # fmt: skip


# --------------------------------------------------------------------------- the workers


class KillDuringRewind:
    """SIGKILLs this worker while a rewind loads its checkpoint, if ``REWIND_ARMS`` names this
    rank for that rewind (numbered by the ranges already in ``data_skips.json``); once each."""

    def __init__(self, dump_folder: Path, rank: int) -> None:
        self.folder, self.rank = dump_folder, rank

    @hookimpl
    def checkpoint_loaded(self) -> None:
        skips = self.folder / "data_skips.json"
        arms = self.folder / REWIND_ARMS
        if not (skips.exists() and arms.exists()):
            return
        record = json.loads(skips.read_text())
        if record.get("rewind") is None:
            return  # a resume, not a rewind
        number = len(record["ranges"])
        marker = self.folder / f"chaos_rewind_killed_{number}"
        if json.loads(arms.read_text()).get(str(number)) == self.rank and not marker.exists():
            marker.write_text(str(self.rank))
            os.kill(os.getpid(), signal.SIGKILL)


def worker(dump_folder: str, mode: str, steps: int, interval: int, store: str) -> None:
    """One torchrun worker: the soak's run, resumed from its dump folder if it has one; with
    ``store`` a URL, its checkpoints there and the rest in ``dump_folder``."""
    from plugtrain.testing import PoisonBatches, make_trainer

    folder = Path(dump_folder)
    plugins = [
        ("poison", PoisonBatches(set().union(*POISONED))),
        ("chaos", KillDuringRewind(folder, int(os.environ["RANK"]))),
    ]
    where: list[str | Path] = [folder]
    if store != "local":  # ema's export writes beside local checkpoints only
        where = [store, "--job.local_folder", str(folder), "--ema.export", "false"]
    make_trainer(
        where[0], *where[1:], *run_args(mode, interval), steps=steps, plugins=plugins
    ).run()


class Checkpoints:
    """A soak's checkpoints as the killer and the verdict see them: in the local folder, or at
    an S3 prefix (``store``: ``local`` or the URL)."""

    def __init__(self, folder: Path, store: str) -> None:
        from plugtrain.checkpoint.object_store import open_storage

        self.store = store
        self.storage = open_storage(folder if store == "local" else store)

    def being_written(self, since: float) -> list[str]:
        """The checkpoints being written by the workers started at ``since``: ``.partial``
        folders, or prefixes without a marker, changed since; older ones are a killed save's,
        removed later."""
        from plugtrain.checkpoint.object_store import MARKER

        if self.store == "local":
            try:
                return [
                    p.name
                    for p in self.storage.location.iterdir()
                    if p.name.endswith(".partial") and p.stat().st_mtime > since
                ]
            except FileNotFoundError:
                return []
        fs, root = self.storage.fs, self.storage.root
        fs.invalidate_cache(root)
        try:
            found = fs.find(root, detail=True)
        except FileNotFoundError:
            return []
        marked, changed = set(), set()
        for name, info in found.items():
            step_dir, _, leaf = name[len(root) + 1 :].partition("/")
            marked.update([step_dir] if leaf == MARKER else [])
            if info["LastModified"].timestamp() > since:
                changed.add(step_dir)
        return sorted(changed - marked)

    def leftovers(self) -> list[str]:
        """What crashes left that no clean-up removed: ``.partial``, ``.deleting`` folders or
        unmarked prefixes."""
        if self.store == "local":
            return [
                p.name
                for p in self.storage.location.iterdir()
                if p.name.endswith((".partial", ".deleting"))
            ]
        return self.being_written(0.0)

    def read_final(self) -> dict[str, Any]:
        from plugtrain.checkpoint import read_checkpoint

        step = self.storage.steps()[-1]
        return read_checkpoint(self.storage.where(step), reader=self.storage.reader(step))


# --------------------------------------------------------------------------- the killer


@dataclass
class Kill:
    kind: str
    """``save``, ``between``, ``rewind`` or ``preempt`` (SIGTERM to torchrun)."""
    target_step: int
    rank: int
    sent_at: float = 0.0
    step_before: int = 0
    """The last step recorded when it was sent."""
    resumed_step: int | None = None
    recovery_s: float | None = None
    """From the kill to the next completed step."""
    finished: bool = False
    """The run had no step left to train after it (a preemption near the end saves the last
    step, and the same command again finds the run done): survived without a next step."""


@dataclass
class Soak:
    folder: Path
    mode: str
    steps: int
    interval: int
    port: int
    restarts: int
    store: str = "local"
    """``local``, or the S3 URL of the checkpoints."""
    launches: int = 0
    log: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            f"--max-restarts={self.restarts}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id=chaos-{self.port}",
            "--monitor-interval=0.05",
            str(Path(__file__).resolve()), "worker", str(self.folder), self.mode,
            str(self.steps), str(self.interval), self.store,
        ]  # fmt: skip

    def launch(self) -> subprocess.Popen:
        self.launches += 1
        env = {
            **os.environ,
            # docs/checkpoints.md: torch 2.13's restarts need it (pytorch#135712).
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        out = (self.folder.parent / f"{self.folder.name}.log").open("a")
        return subprocess.Popen(
            self.command(), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def last_step(folder: Path) -> int:
    """The last training step in ``metrics.jsonl`` (0 if none)."""
    path = folder / "metrics.jsonl"
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "loss" in record:
            return record["step"]
    return 0


def resumed_since(folder: Path, since: float) -> int | None:
    """The step the run started after ``since`` resumed from (0: afresh); None if none yet."""
    path = folder / "run.json"
    try:
        if path.stat().st_mtime < since:
            return None
        resumed = json.loads(path.read_text())["resumed_from"]
    except (FileNotFoundError, ValueError):
        return None
    return 0 if resumed is None else resumed["step"]


def workers(torchrun: int) -> dict[int, int]:
    """torchrun's worker processes, pid by rank."""
    found = {}
    for task in Path(f"/proc/{torchrun}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for var in env:
                if var.startswith(b"RANK="):
                    found[int(var[5:])] = int(pid)
    return found


def started_at(folder: Path) -> float:
    """When the workers running now started (``run.json``); infinity before they write it."""
    try:
        return (folder / "run.json").stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def schedule(rng: random.Random, kills: int, steps: int) -> tuple[list[Kill], dict[str, int]]:
    """The seeded plan: targeted kills at increasing steps (so that the run always advances),
    one of them the preemption; and the rewinds whose load a worker dies in."""
    rewinds = min(len(POISONED), max(1, kills // 4), kills)
    rewind_arms = {str(n): rng.randrange(2) for n in range(rewinds)}
    targeted = kills - len(rewind_arms)
    steps_at = sorted(rng.sample(range(2, steps), targeted + 1))
    preempt = rng.randrange(len(steps_at))
    plan = [
        Kill(
            "preempt" if i == preempt else rng.choice(("save", "between")),
            step,
            rng.randrange(2),
        )
        for i, step in enumerate(steps_at)
    ]
    return plan, rewind_arms


def soak(soak: Soak, plan: list[Kill], rewind_arms: dict[str, int], rng: random.Random) -> dict:
    """Run ``soak`` to its end under the killer; return what happened."""
    soak.folder.mkdir(parents=True)
    checkpoints = Checkpoints(soak.folder, soak.store)
    (soak.folder / REWIND_ARMS).write_text(json.dumps(rewind_arms))
    start = time.perf_counter()
    proc = soak.launch()
    done: list[Kill] = []
    pending = list(plan)
    rewinds_seen: set[int] = set()
    progress_at, progress = time.perf_counter(), -1
    while True:
        now = time.time()
        step = last_step(soak.folder)
        if step != progress:
            progress, progress_at = step, time.perf_counter()
        if time.perf_counter() - progress_at > 300:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"{soak.folder}: no step for 300 s after step {step}: a hang")
        for n in map(int, rewind_arms):
            marker = soak.folder / f"chaos_rewind_killed_{n}"
            if n not in rewinds_seen and marker.exists():
                rewinds_seen.add(n)
                kill = Kill("rewind", step, rewind_arms[str(n)], marker.stat().st_mtime, step)
                done.append(kill)
        for kill in done:
            if kill.recovery_s is None:
                if kill.resumed_step is None:
                    kill.resumed_step = resumed_since(soak.folder, kill.sent_at)
                if kill.resumed_step is not None and step > kill.resumed_step:
                    kill.recovery_s = now - kill.sent_at
        rc = proc.poll()
        if rc is not None:
            preempted = done and done[-1].kind == "preempt" and done[-1].resumed_step is None
            if preempted and soak.launches < 2:
                proc = soak.launch()
                continue
            if rc != 0:
                raise RuntimeError(f"torchrun ended with {rc}: see {soak.folder}.log")
            ended_at = last_step(soak.folder)
            for kill in done:
                kill.finished = kill.recovery_s is None and ended_at == soak.steps
            break
        recovering = any(k.recovery_s is None for k in done)
        if pending and not recovering and step >= pending[0].target_step:
            kill = pending[0]
            if kill.kind == "preempt":
                proc.send_signal(signal.SIGTERM)
            elif kill.kind == "save" and not checkpoints.being_written(started_at(soak.folder)):
                time.sleep(AIM_S)
                continue
            elif kill.kind == "between":
                time.sleep(rng.uniform(0, 0.2))
                if (
                    checkpoints.being_written(started_at(soak.folder))
                    or last_step(soak.folder) < kill.target_step
                ):
                    continue
            if kill.kind != "preempt":
                pid = workers(proc.pid).get(kill.rank)
                if pid is None:  # between two attempts: try again
                    time.sleep(AIM_S)
                    continue
                os.kill(pid, signal.SIGKILL)
            kill.sent_at, kill.step_before = time.time(), last_step(soak.folder)
            done.append(pending.pop(0))
            soak.log.append(f"{kill.kind} rank {kill.rank} at step {kill.step_before}")
        time.sleep(POLL_S)
    return {
        "seconds": time.perf_counter() - start,
        "kills": [asdict(k) for k in done],
        "not_sent": [asdict(k) for k in pending],
        "rewind_kills_not_sent": sorted(set(map(int, rewind_arms)) - rewinds_seen),
        "launches": soak.launches,
    }


# --------------------------------------------------------------------------- the verdict


def training_records(folder: Path) -> list[tuple[int, float]]:
    from plugtrain.testing import read_metrics

    return [(r["step"], r["loss"]) for r in read_metrics(folder) if "loss" in r]


def verdict(run: Path, reference: Path, steps: int, store: str = "local") -> dict[str, Any]:
    """Each check of the soaked run (its checkpoints in ``store``) against the uninterrupted
    one (on the local disk): True, or what differs."""
    checkpoints = Checkpoints(run, store)
    ours, theirs = checkpoints.read_final(), Checkpoints(reference, "local").read_final()
    differing = sorted(
        k for k in ours.keys() | theirs.keys()
        if k not in ours or k not in theirs or not (
            ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape
            and ours[k].view(-1).view(dtype=_bits(ours[k])).equal(
                theirs[k].view(-1).view(dtype=_bits(theirs[k]))))
    )  # fmt: skip

    def equal(prefix: str) -> bool | list[str]:
        bad = [k for k in differing if k.startswith(prefix)]
        return not bad or bad[:5]

    records, expected = training_records(run), training_records(reference)
    steps_seen = [s for s, _ in records]
    leftovers = checkpoints.leftovers()
    kept = len(checkpoints.storage.steps())
    skips = [json.loads((f / "data_skips.json").read_text()) for f in (run, reference)]
    checks: dict[str, Any] = {
        "parameters_bitwise_equal": equal("model."),
        "optimizer_state_bitwise_equal": equal("optimizer."),
        "ema_weights_bitwise_equal": equal("plugins.ema."),
        "every_tensor_bitwise_equal": not differing or differing[:5],
        "each_step_once_in_order": steps_seen == list(range(1, steps + 1)) or steps_seen,
        "losses_equal": records == expected,
        "no_partial_folder_left": leftovers or True,
        "at_most_keep_latest_k_checkpoints": kept <= KEEP or kept,
        "data_skips_equal": skips[0] == skips[1] or skips,
        "rewound": len(skips[1]["ranges"]) == len(POISONED) or skips[1]["ranges"],
    }
    return checks


def _bits(t: Any) -> Any:
    """The integer dtype of ``t``'s element size: compares NaNs and signed zeros bit for bit."""
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]


def figures(kills: list[dict]) -> dict[str, Any]:
    # A preempted run saves after the step it is in (or the next: the stop vote reads a step
    # late), so it may resume after the step seen at SIGTERM: nothing recomputed.
    recomputed = [
        max(0, k["step_before"] - k["resumed_step"]) for k in kills if k["resumed_step"] is not None
    ]
    recovery = [k["recovery_s"] for k in kills if k["recovery_s"] is not None]
    by_kind: dict[str, int] = {}
    for k in kills:
        by_kind[k["kind"]] = by_kind.get(k["kind"], 0) + 1
    return {
        "kills_sent": len(kills),
        "kills_survived": sum(k["recovery_s"] is not None or k["finished"] for k in kills),
        "by_kind": by_kind,
        "steps_recomputed_mean": statistics.mean(recomputed) if recomputed else None,
        "steps_recomputed_max": max(recomputed, default=None),
        "kill_to_next_step_s_mean": statistics.mean(recovery) if recovery else None,
        "kill_to_next_step_s_max": max(recovery, default=None),
    }


# --------------------------------------------------------------------------- main


def run_mode(args: Any, mode: str, root: Path, server: Any = None) -> dict[str, Any]:
    """The soak of one ``checkpoint.async_mode``; with ``server`` (an ``S3Server``), its
    checkpoints on S3 (the reference's stay on the local disk)."""
    rng = random.Random(f"{args.seed}-{mode}")
    plan, arms = schedule(rng, args.kills, args.steps)
    from plugtrain.testing import free_port

    reference = Soak(root / f"{mode}-reference", mode, args.steps, args.interval, free_port(), 0)
    soak(reference, [], {}, rng)
    store = "local" if server is None else server.url(f"chaos-{root.name}/{mode}-soaked")
    soaked = Soak(root / f"{mode}-soaked", mode, args.steps, args.interval, free_port(),
                  args.kills + 2, store)  # fmt: skip
    happened = soak(soaked, plan, arms, rng)
    checks = verdict(soaked.folder, reference.folder, args.steps, store)
    return {
        "mode": mode,
        "store": args.store,
        "passed": all(v is True for v in checks.values()),
        "checks": checks,
        "figures": figures(happened["kills"]),
        **happened,
    }


def add_arguments(parser: Any) -> None:
    parser.add_argument("--kills", type=int, default=20, help="default: %(default)s")
    parser.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    parser.add_argument(
        "--steps", type=int, default=None, help="default: 2 x kills + 8, at least 28"
    )
    parser.add_argument("--interval", type=int, default=4, help="checkpoint interval")
    parser.add_argument("--modes", default="disabled,async", help="checkpoint.async_mode values")
    parser.add_argument("--folder", type=Path, default=None, help="default: a temp folder")
    parser.add_argument(
        "--store", choices=("local", "s3"), default="local",
        help="where the soaked run's checkpoints go: the local disk, or an S3 server on "
        "127.0.0.1 started here (default: %(default)s)",
    )  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        folder, mode, steps, interval, store = sys.argv[2:7]
        worker(folder, mode, int(steps), int(interval), store)
        return
    args = benchlib.parse_args("chaos", __doc__.splitlines()[0], add_arguments)
    if args.quick:
        args.kills, args.modes = min(args.kills, 3), "async"
    # The poisoned batches come before step 28; each kill needs a step of its own.
    args.steps = args.steps or max(28, 2 * args.kills + 8)
    import tempfile

    root = args.folder or Path(tempfile.mkdtemp(prefix="plugtrain-chaos-"))
    with contextlib.ExitStack() as stack:
        server = None
        if args.store == "s3":
            from plugtrain.testing import S3Server

            server = stack.enter_context(S3Server())
            stack.enter_context(server.environ())  # the workers inherit it
        results = [run_mode(args, mode, root, server) for mode in args.modes.split(",")]
    rows = []
    for r in results:
        f = r["figures"]
        rows.append([
            r["mode"], "PASS" if r["passed"] else "FAIL", f["kills_sent"], f["kills_survived"],
            ", ".join(f"{k} {n}" for k, n in sorted(f["by_kind"].items())),
            f["steps_recomputed_mean"], f["steps_recomputed_max"],
            f["kill_to_next_step_s_mean"], f["kill_to_next_step_s_max"], r["seconds"],
        ])  # fmt: skip
    print(benchlib.table(
        ["async_mode", "verdict", "kills", "survived", "kinds", "recomputed mean",
         "recomputed max", "kill to step s mean", "max", "soak s"], rows))  # fmt: skip
    for r in results:
        failed = {k: v for k, v in r["checks"].items() if v is not True}
        print(f"{r['mode']}: " + ("all checks passed" if not failed else f"FAILED {failed}"))
    print(f"runs in {root} (seed {args.seed})")
    benchlib.write_json(args.out, "chaos", args, {"seed": args.seed, "modes": results})
    if not all(r["passed"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
