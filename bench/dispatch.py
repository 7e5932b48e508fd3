"""Microseconds per training step spent dispatching plugtrain's step hooks.

Fires the hook sequence of one training step (``pre_backward`` once per microbatch, the
gradient phases ``unscale_gradients``, ``observe_gradients``, ``post_backward`` and
``pre_step`` with its vetoes combined, then ``post_step``, exactly as ``Trainer.train_step``
does) through
``PluginHost.hook`` with 0, 2 and 10 registered no-op plugins, no model work in between, and
reports the time per step. A direct Python call of the same no-op functions is the floor:
pluggy's dispatch is the difference.

Then the shipped grad_clip and grad_scaler plugins, on the real gradients of the tiny model
(``--flavor`` picks another), in bfloat16 (the scaler deactivates itself) and float16: their
dispatch (measured with empty stand-ins for exactly their hooks), their bodies, and the bare
torch calls a hand-written loop makes for the same work (see :func:`shipped`). Target: dispatch
under 20 us per step.

Each number is given as min / median over the repetitions: the minimum estimates the
intrinsic cost (other processes can only add time), the median shows the machine's load.

    python bench/dispatch.py            # about a minute
    python bench/dispatch.py --quick
"""

from __future__ import annotations

import argparse
import functools
import time
import types
from collections.abc import Callable

import benchlib
import torch
from torch.distributed.tensor import DTensor

from plugtrain.host.plugin_host import PluginHost
from plugtrain.plugin import StepContext, hookimpl
from plugtrain.training.vetoes import Vetoes

NAME = "dispatch"
STEP_HOOKS = (
    "pre_backward", "unscale_gradients", "observe_gradients", "post_backward", "pre_step",
    "post_step",
)  # fmt: skip
VETOES = Vetoes(torch.device("cpu"))
"""Combines the vetoes of the fired steps, as the trainer's does."""
TARGET_US = 20.0


class NoOp:
    """A plugin implementing every step hook with an empty body."""

    @hookimpl
    def pre_backward(self, ctx: StepContext) -> None:
        pass

    @hookimpl
    def unscale_gradients(self, ctx: StepContext) -> None:
        pass

    @hookimpl
    def observe_gradients(self, ctx: StepContext) -> None:
        pass

    @hookimpl
    def post_backward(self, ctx: StepContext) -> None:
        pass

    @hookimpl
    def pre_step(self, ctx: StepContext) -> str | None:
        return None

    @hookimpl
    def post_step(self, ctx: StepContext) -> None:
        pass


def fire_step(host: PluginHost, ctx: StepContext) -> None:
    """The hook calls of one ``Trainer.train_step``, with the step's own work left out.

    NOTE: mirrors the hook calls of ``Trainer.train_step`` line for line (the loop variable,
    the combined vetoes), without its step timer's laps; keep the two in step.
    """
    hook, microbatches = host.hook, ctx.num_microbatches
    for ctx.microbatch in range(microbatches):
        hook.pre_backward(ctx=ctx)
    hook.unscale_gradients(ctx=ctx)
    hook.observe_gradients(ctx=ctx)
    hook.post_backward(ctx=ctx)
    vetoes = host.results("pre_step", ctx=ctx)
    ctx.skipped, ctx.skip_reasons = VETOES.combine(vetoes)
    hook.post_step(ctx=ctx)


def direct_caller(host: PluginHost) -> Callable[[StepContext], None]:
    """A function making the same calls as :func:`fire_step`, in the same order, without pluggy.

    The implementations are looked up once, here, so that the function measures plain Python
    calls of the plugins' bodies: the floor that dispatch through pluggy is compared with.
    """
    # pluggy calls the implementations in reverse order of get_hookimpls(); each asks for
    # ctx or for nothing.
    pre_backward, unscale, observe, post_backward, pre_step, post_step = (
        [(i.function, bool(i.argnames)) for i in reversed(getattr(host.hook, name).get_hookimpls())]
        for name in STEP_HOOKS
    )
    pre_step_names = [i.plugin_name for i in reversed(host.hook.pre_step.get_hookimpls())]

    def step(ctx: StepContext) -> None:
        microbatches = ctx.num_microbatches
        for ctx.microbatch in range(microbatches):
            for f, takes_ctx in pre_backward:
                f(ctx=ctx) if takes_ctx else f()
        for phase in (unscale, observe, post_backward):
            for f, takes_ctx in phase:
                f(ctx=ctx) if takes_ctx else f()
        answers = {
            name: a
            for name, (f, t) in zip(pre_step_names, pre_step, strict=True)
            if (a := f(ctx=ctx) if t else f()) is not None
        }
        ctx.skipped, ctx.skip_reasons = VETOES.combine(answers)
        for f, takes_ctx in post_step:
            f(ctx=ctx) if takes_ctx else f()

    return step


def us_per_step(
    run: Callable[[StepContext], None],
    ctx: StepContext,
    steps: int,
    reset: Callable[[], None] | None = None,
) -> list[float]:
    """Microseconds per step of ``steps`` calls of ``run(ctx)``.

    Without ``reset``: one number, the mean over the steps (a no-op step takes microseconds,
    too little to time alone). With ``reset``, which runs untimed before each step (it
    restores the gradients that the shipped plugins modify in place): one number per step.
    """
    if reset is None:
        start = time.perf_counter_ns()
        for _ in range(steps):
            run(ctx)
        return [(time.perf_counter_ns() - start) / steps / 1e3]
    times = []
    for _ in range(steps):
        reset()
        start = time.perf_counter_ns()
        run(ctx)
        times.append((time.perf_counter_ns() - start) / 1e3)
    return times


def alternate(
    runs: dict[str, Callable[[StepContext], None]],
    ctx: StepContext,
    steps: int,
    reps: int,
    reset: Callable[[], None] | None = None,
) -> dict[str, dict[str, float]]:
    """A summary of each run's microseconds per step over ``reps`` turns of ``steps`` steps."""
    for run in runs.values():  # warm-up
        us_per_step(run, ctx, steps, reset)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            times[name] += us_per_step(run, ctx, steps, reset)
    return {name: benchlib.summary(t) for name, t in times.items()}


def noop_host(n_plugins: int) -> PluginHost:
    host = PluginHost()
    for i in range(n_plugins):
        host.register(NoOp(), f"noop{i}")
    return host


def stand_in(host: PluginHost, name: str) -> object:
    """A plugin with empty bodies for exactly the step hooks that plugin ``name`` implements,
    with the same ``tryfirst``/``trylast`` marks: what dispatching its hooks costs, without its
    work."""
    plugin = types.SimpleNamespace()
    for hook_name in STEP_HOOKS:
        for impl in getattr(host.hook, hook_name).get_hookimpls():
            if impl.plugin_name == name:

                def empty(ctx: StepContext) -> None:
                    return None

                mark = hookimpl(tryfirst=impl.tryfirst, trylast=impl.trylast)
                setattr(plugin, hook_name, mark(empty))
    return plugin


class _NoStep:
    """Stands in for the optimizer in the bare GradScaler calls: ``step()`` does nothing."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups = optimizer.param_groups

    def step(self) -> None:
        pass


def shipped(flavor: str, dtype: str, accum: int, steps: int, reps: int) -> dict:
    """The hooks of the shipped grad_clip and grad_scaler plugins, on a model's real gradients.

    Times per step: (1) no-op stand-ins for the hooks the active plugins implement, through
    pluggy and called directly: the dispatch cost, precisely; (2) the real plugins through
    pluggy, (3) their bodies called directly, and (4) the bare torch calls a hand-written loop
    makes for the same work (clip; scale, unscale_, step's inf check, update). (3) - (4) is
    what the plugins' own Python adds to the work; the gradients are restored before each step.
    Also times one ``list(ctx.model.parameters())``, the walk of the module tree that
    ``ctx.params`` saves: grad_clip made one per step before the trainer held that tuple.
    """
    from plugtrain.model import cross_entropy
    from plugtrain.training.launch import configure
    from plugtrain.training.trainer import Trainer

    train_args = benchlib.trainer_args(
        flavor,
        dtype,
        "--plugins.enabled", "grad_clip,grad_scaler",
        "--training.grad_accum_steps", str(accum),
        batch_size=4 * accum,
        seq_len=32,
    )  # fmt: skip
    trainer = Trainer(*configure(train_args))
    host, model = trainer.host, trainer.model
    trainer.train_step(trainer.batches.next_batch())  # every lazy initialisation, untimed
    inputs, targets, *_ = trainer.batches.next_batch()[0]
    loss = cross_entropy(model(inputs), targets)
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    saved = [p.grad.detach().clone() for p in params]
    ctx = StepContext(2, accum, model, trainer.optimizer, trainer.params)

    def reset() -> None:
        for p, g in zip(params, saved, strict=True):
            p.grad.copy_(g)
        ctx.loss = loss.detach()

    clip_cfg = trainer.config.plugin("grad_clip")
    scaler = (
        torch.amp.GradScaler("cpu", init_scale=trainer.config.plugin("grad_scaler").init_scale)
        if "grad_scaler" in host.names()
        else None
    )
    no_step = _NoStep(trainer.optimizer)

    def bare(ctx: StepContext) -> None:
        if scaler is not None:
            for _ in range(ctx.num_microbatches):
                ctx.loss = scaler.scale(ctx.loss)
            scaler.unscale_(no_step)  # type: ignore[arg-type]
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads, clip_cfg.norm_type, foreach=True)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        torch.nn.utils.clip_grads_with_norm_(params, clip_cfg.max_norm, norm, foreach=True)
        if scaler is not None:
            scaler.step(no_step)  # type: ignore[arg-type]
            scaler.update()

    stand_ins = PluginHost()
    for name in host.names():
        stand_ins.register(stand_in(host, name), name)
    reset()
    empty = alternate(
        {"hooks": functools.partial(fire_step, stand_ins), "direct": direct_caller(stand_ins)},
        ctx,
        steps * 10,
        reps,
    )
    real = alternate(
        {
            "hooks": functools.partial(fire_step, host),
            "direct": direct_caller(host),
            "bare": bare,
        },
        ctx,
        steps,
        reps,
        reset,
    )
    traversal = alternate({"walk": lambda ctx: list(ctx.model.parameters())}, ctx, steps, reps)
    return {
        "flavor": flavor,
        "dtype": dtype,
        "grad_accum_steps": accum,
        "active_plugins": host.names(),
        "hooks_implemented": {name: host.hooks_of(name) for name in host.names()},
        "stand_ins_us_per_step": empty["hooks"],
        "stand_ins_direct_us_per_step": empty["direct"],
        "dispatch_us_per_step": difference(empty["hooks"], empty["direct"]),
        "plugins_us_per_step": real["hooks"],
        "plugin_bodies_us_per_step": real["direct"],
        "bare_torch_us_per_step": real["bare"],
        "plugin_python_us_per_step": difference(real["direct"], real["bare"]),
        "model_parameters_us_per_call": traversal["walk"],
    }


def difference(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """``a - b`` of two summaries, of their minimums and of their medians.

    NOTE: the minimum over repetitions is the estimate of the intrinsic cost: other processes
    on the machine can only add time to a repetition. The median shows the load of the moment.
    """
    return {"min": a["min"] - b["min"], "median": a["median"] - b["median"]}


def min_median(summary: dict[str, float]) -> str:
    return f"{summary['min']:.3g} / {summary['median']:.3g}"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--flavor", default="tiny", help="model of the shipped plugins' part (default: %(default)s)"
    )


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0], add_args)
    steps, reps = (200, 5) if args.quick else (2000, 25)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    noop, rows = [], []
    for n_plugins in (0, 2, 10):
        host = noop_host(n_plugins)
        for accum in (1, 4):
            ctx = StepContext(1, accum, model, optimizer, tuple(model.parameters()))
            times = alternate(
                {"hooks": functools.partial(fire_step, host), "direct": direct_caller(host)},
                ctx,
                steps,
                reps,
            )
            r = {
                "plugins": n_plugins,
                "grad_accum_steps": accum,
                "hook_calls_per_step": accum + 5,
                "us_per_step": times["hooks"],
                "direct_call_us_per_step": times["direct"],
                "dispatch_us_per_step": difference(times["hooks"], times["direct"]),
            }
            noop.append(r)
            rows.append([
                n_plugins, accum, accum + 5, min_median(r["us_per_step"]),
                min_median(r["direct_call_us_per_step"]), min_median(r["dispatch_us_per_step"]),
            ])  # fmt: skip
    print("Hook dispatch with no-op plugins, microseconds per step (min / median):\n")
    print(
        benchlib.table(
            ["no-op plugins", "accum", "hook calls", "via hooks", "direct calls", "dispatch"],
            rows,
        )
    )
    shipped_results, rows = [], []
    for dtype in ("bfloat16", "float16"):
        for accum in (1, 4):
            # NOTE: fewer, longer steps: the real hooks run kernels (about a millisecond).
            r = shipped(args.flavor, dtype, accum, steps // 20, reps * 3 // 5)
            r["target_met"] = r["dispatch_us_per_step"]["min"] < TARGET_US
            shipped_results.append(r)
            rows.append([
                dtype, accum, ",".join(r["active_plugins"]),
                min_median(r["dispatch_us_per_step"]), min_median(r["stand_ins_us_per_step"]),
                min_median(r["plugins_us_per_step"]), min_median(r["plugin_bodies_us_per_step"]),
                min_median(r["bare_torch_us_per_step"]),
                min_median(r["plugin_python_us_per_step"]),
                min_median(r["model_parameters_us_per_call"]),
                "yes" if r["target_met"] else "NO",
            ])  # fmt: skip
    print(
        f"\nThe shipped plugins ({args.flavor} model, 1 process), microseconds per step"
        " (min / median):\n"
    )
    print(
        benchlib.table(
            [
                "dtype",
                "accum",
                "active plugins",
                "dispatch",
                "stand-ins via hooks",
                "plugins via hooks",
                "bodies called directly",
                "bare torch calls",
                "plugin Python",
                "one model.parameters()",
                f"dispatch < {TARGET_US:g} us",
            ],
            rows,
        )
    )
    benchlib.write_json(
        args.out,
        NAME,
        args,
        {"noop": noop, "shipped": shipped_results, "target_us": TARGET_US},
    )


if __name__ == "__main__":
    main()
