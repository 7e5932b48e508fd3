"""The hook trace: the plugins each hook call ran, in order, with their time and device costs.

Off by default, and then it costs nothing: nothing in this module is installed, the hook
implementations pluggy calls are the plugins' own functions, and no monitoring is added.
Turned on by ``[metrics] trace_hooks = true`` or the environment variable
``PLUGTRAIN_TRACE_HOOKS=1``, :meth:`HookTracer.install`

* wraps each registered hook implementation (``HookImpl.function``) in a timer and a
  :class:`~plugtrain.observability.costs.CostCounter` (host syncs and collectives), and
* adds pluggy hook-call monitoring (``PluginManager.add_hookcall_monitoring``) around each call,

and every rank writes one JSON line per hook call to ``<dump_folder>/hook_trace.rank<N>.jsonl``::

    {"hook": "post_backward", "step": 3, "microbatch": 0, "ms": 0.081, "syncs": 0,
     "collectives": 1, "plugins": [
       {"plugin": "grad_scaler", "ms": 0.052, "syncs": 0, "collectives": 0},
       {"plugin": "grad_clip", "ms": 0.017, "syncs": 0, "collectives": 1}]}

``plugins`` lists the implementations in the order they started (a ``wrapper=True``
implementation is marked ``"wrapper": true``; its time and costs are those of its own code
before and after its ``yield``, not of the implementations it wraps). ``ms`` of the call
includes pluggy's dispatch; its ``syncs`` and ``collectives`` are the sums of its plugins'.
Counting makes every torch call inside a hook slower (Python handlers see each op), so traced
times are those of counted code. Every hook call goes through pluggy, result hooks
(:meth:`PluginHost.results`) included, and is one line; ``load_state_dict``, fired for one
plugin at a time, is one line per plugin. When the run closes, the time spent in each plugin's
hooks, with its host syncs and collectives per call, is logged as a table (rank 0) and written
as the file's last line, ``{"summary": {...}}``, which also names where each sync happened and
each collective's op.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plugtrain.errors import ConfigError
from plugtrain.host import Implementation, PluginHost
from plugtrain.observability.costs import CostCounter

logger = logging.getLogger("plugtrain")

ENV_VAR = "PLUGTRAIN_TRACE_HOOKS"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def tracing_requested(option: bool) -> bool:
    """Whether to trace hooks: ``PLUGTRAIN_TRACE_HOOKS`` when set, else the config option."""
    value = os.environ.get(ENV_VAR)
    if value is None:
        return option
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ConfigError(f"environment variable {ENV_VAR}={value!r}: use 1 (trace hooks) or 0")


@dataclass
class _Entry:
    """One implementation's share of a hook call: its time and what it cost the device."""

    plugin: str
    wrapper: bool
    seconds: float = 0.0
    costs: CostCounter = field(default_factory=CostCounter)


@dataclass
class _Call:
    """One hook call being traced, with its implementations in the order they started."""

    hook: str
    step: int | None
    microbatch: int | None
    start: float = field(default_factory=time.perf_counter)
    plugins: list[_Entry] = field(default_factory=list)


@dataclass
class _Totals:
    """What the calls of one plugin's hook (or of one whole hook) added up to."""

    calls: int = 0
    seconds: float = 0.0
    syncs: Counter[str] = field(default_factory=Counter)
    """By cause and site (:attr:`CostCounter.sync_sites`)."""
    collectives: Counter[str] = field(default_factory=Counter)

    def add(self, seconds: float, costs: Iterable[CostCounter]) -> None:
        self.calls += 1
        self.seconds += seconds
        for counter in costs:
            self.syncs.update(counter.sync_sites)
            self.collectives.update(counter.collectives)

    def as_dict(self, details: bool) -> dict[str, Any]:
        totals: dict[str, Any] = {
            "calls": self.calls,
            "ms": self.seconds * 1e3,
            "syncs": sum(self.syncs.values()),
            "collectives": sum(self.collectives.values()),
        }
        if details and self.syncs:
            totals["sync_sites"] = dict(self.syncs.most_common())
        if details and self.collectives:
            totals["collective_ops"] = dict(self.collectives.most_common())
        return totals


def _position(kwargs: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """The step and microbatch of a hook call, from its ``ctx`` argument when it has one."""
    ctx = kwargs.get("ctx")
    return getattr(ctx, "step", None), getattr(ctx, "microbatch", None)


class HookTracer:
    """Times every hook implementation of a :class:`PluginHost`, counts its host syncs and
    collectives, and writes the trace.

    Build it with :meth:`install`; :meth:`close` restores the plugins' functions, removes the
    monitoring, writes and logs the summary, and returns it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a")
        self._stack: list[_Call] = []
        self._undo: list[Callable[[], None]] = []
        self._by_plugin: dict[tuple[str, str], _Totals] = {}
        self._by_hook: dict[str, _Totals] = {}

    @classmethod
    def install(cls, host: PluginHost, dump_folder: str | Path, rank: int) -> HookTracer:
        """Start tracing every implementation registered in ``host`` now, into
        ``<dump_folder>/hook_trace.rank<rank>.jsonl``.

        Plugins registered after this call are not traced (the trainer installs the tracer once
        every enabled plugin is registered, before the ``setup`` hook).
        """
        Path(dump_folder).mkdir(parents=True, exist_ok=True)
        tracer = cls(Path(dump_folder) / f"hook_trace.rank{rank}.jsonl")
        tracer._undo = [host.wrap_implementations(tracer._timed)]
        tracer._undo.append(host.monitor_calls(tracer._before, tracer._after))
        return tracer

    # ------------------------------------------------------------------ per hook call

    def _before(self, hook: str, kwargs: Mapping[str, Any]) -> None:
        self._stack.append(_Call(hook, *_position(kwargs)))

    def _after(self, hook: str, error: BaseException | None) -> None:
        self._finish(self._stack.pop(), error)

    def _finish(self, call: _Call, error: BaseException | None) -> None:
        seconds = time.perf_counter() - call.start
        plugins = []
        for e in call.plugins:
            plugins.append(
                {
                    "plugin": e.plugin,
                    "ms": round(e.seconds * 1e3, 4),
                    "syncs": e.costs.num_syncs,
                    "collectives": e.costs.num_collectives,
                    **({"wrapper": True} if e.wrapper else {}),
                }
            )
        record: dict[str, Any] = {
            "hook": call.hook,
            "step": call.step,
            "microbatch": call.microbatch,
            "ms": round(seconds * 1e3, 4),
            "syncs": sum(p["syncs"] for p in plugins),
            "collectives": sum(p["collectives"] for p in plugins),
            "plugins": plugins,
        }
        if error is not None:
            record["error"] = type(error).__name__
        self._file.write(json.dumps(record) + "\n")
        self._by_hook.setdefault(call.hook, _Totals()).add(seconds, (e.costs for e in call.plugins))
        for e in call.plugins:
            self._by_plugin.setdefault((e.plugin, call.hook), _Totals()).add(e.seconds, [e.costs])

    def _timed(self, impl: Implementation, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` wrapped to add its running time and costs to the current call of its
        hook."""
        plugin, wrapper = impl.plugin, impl.wrapper

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            entry = _Entry(plugin, wrapper)
            self._stack[-1].plugins.append(entry)  # the hook's call, which pluggy monitors
            start = time.perf_counter()
            try:
                with entry.costs:
                    result = function(*args, **kwargs)
                # A wrapper's function returns its generator; pluggy drives it later.
                return self._timed_generator(result, entry) if wrapper else result
            finally:
                entry.seconds += time.perf_counter() - start

        return timed

    @staticmethod
    def _timed_generator(gen: Generator, entry: _Entry) -> Generator:
        """Drive a wrapper implementation's generator for pluggy, adding to ``entry`` only the
        time and costs of the generator's own code (before and after its ``yield``), not those
        of the implementations it wraps while suspended (PEP 380's ``yield from``, written out
        so that each resumption is timed and counted)."""
        send: Callable[[Any], Any] = gen.send
        arg: Any = None
        while True:
            start = time.perf_counter()
            try:
                with entry.costs:
                    value = send(arg)
            except StopIteration as stop:
                return stop.value
            finally:
                entry.seconds += time.perf_counter() - start
            try:
                arg, send = (yield value), gen.send
            except GeneratorExit:
                gen.close()
                raise
            except BaseException as e:
                arg, send = e, gen.throw

    # ------------------------------------------------------------------ the end of the run

    def summary(self) -> dict[str, Any]:
        """By plugin and hook: calls, milliseconds, host syncs and collectives, with where
        each sync happened (``sync_sites``) and each collective's op (``collective_ops``); and
        the same totals for whole hook calls, by hook."""
        plugins: dict[str, dict[str, dict[str, Any]]] = {}
        for (plugin, hook), totals in sorted(self._by_plugin.items()):
            plugins.setdefault(plugin, {})[hook] = totals.as_dict(details=True)
        hooks = {h: t.as_dict(details=False) for h, t in sorted(self._by_hook.items())}
        return {"plugins": plugins, "hooks": hooks}

    def close(self) -> dict[str, Any]:
        """Stop tracing: restore the functions, write and log the summary, return it."""
        while self._undo:
            self._undo.pop()()
        summary = self.summary()
        self._file.write(json.dumps({"summary": summary}) + "\n")
        self._file.close()
        logger.info(
            "time and device costs in hooks, by plugin (trace: %s)\n%s",
            self.path,
            format_summary(summary),
        )
        return summary


_COLUMNS = ("calls", "ms", "syncs", "collectives")


def format_summary(summary: Mapping[str, Any]) -> str:
    """The summary as a table: one row per plugin and hook, a total per plugin, and the time of
    whole hook calls (implementations plus pluggy's dispatch), with host syncs and collectives
    per call; then where each plugin's syncs happened."""
    header = ("plugin", "hook", "calls", "total ms", "mean ms", "syncs/call", "collectives/call")
    rows = [header]

    def row(plugin: str, hook: str, calls: float, ms: float, syncs: float, colls: float) -> None:
        def mean(x: float) -> float:
            return x / calls if calls else 0.0

        rows.append(
            (plugin, hook, f"{calls:.0f}", f"{ms:.3f}", f"{mean(ms):.4f}", f"{mean(syncs):.2f}",
             f"{mean(colls):.2f}")
        )  # fmt: skip

    def total(tables: Iterable[Mapping[str, Any]]) -> list[float]:
        tables = list(tables)
        return [sum(t[k] for t in tables) for k in _COLUMNS]

    sites = []
    for plugin, hooks in summary["plugins"].items():
        for hook, t in hooks.items():
            row(plugin, hook, *(t[k] for k in _COLUMNS))
            sites += [
                f"  {plugin} {hook}: {n} x {site}" for site, n in t.get("sync_sites", {}).items()
            ]
        if len(hooks) > 1:
            row(plugin, "(all)", *total(hooks.values()))
    row("(hook calls)", "(all)", *total(summary["hooks"].values()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [
        "  "
        + "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    if sites:
        lines += ["host syncs, by plugin, hook and site:", *sites]
    return "\n".join(lines)
