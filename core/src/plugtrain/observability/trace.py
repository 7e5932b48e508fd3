"""The hook trace: which plugins ran, in which order, and for how long, at every hook call.

Off by default, and then it costs nothing: nothing in this module is installed, the hook
implementations pluggy calls are the plugins' own functions, and no monitoring is added.
Turned on by ``[metrics] trace_hooks = true`` or the environment variable
``PLUGTRAIN_TRACE_HOOKS=1``, :meth:`HookTracer.install`

* wraps each registered hook implementation (``HookImpl.function``) in a timer, and
* adds pluggy hook-call monitoring (``PluginManager.add_hookcall_monitoring``) around each call,

and every rank writes one JSON line per hook call to ``<dump_folder>/hook_trace.rank<N>.jsonl``::

    {"hook": "post_backward", "step": 3, "microbatch": 0, "ms": 0.081,
     "plugins": [{"plugin": "grad_scaler", "ms": 0.052}, {"plugin": "grad_clip", "ms": 0.017}]}

``plugins`` lists the implementations in the order they started (a ``wrapper=True``
implementation is marked ``"wrapper": true``; its time is that of its own code before and after
its ``yield``, not of the implementations it wraps). ``ms`` of the call includes pluggy's
dispatch. Hooks the trainer calls plugin by plugin (``step_metrics``, ``state_dict``, through
:meth:`PluginHost.call_each`) appear as one call per plugin. When the run closes, the time spent
in each plugin's hooks is logged as a table (rank 0) and written as the file's last line,
``{"summary": {...}}``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plugtrain.errors import ConfigError
from plugtrain.host.plugin_host import Implementation, PluginHost

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
class _Call:
    """One hook call being traced: its implementations as ``[plugin, seconds, wrapper]``."""

    hook: str
    step: int | None
    microbatch: int | None
    start: float = field(default_factory=time.perf_counter)
    plugins: list[list[Any]] = field(default_factory=list)


def _position(kwargs: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """The step and microbatch of a hook call, from its ``ctx`` argument when it has one."""
    ctx = kwargs.get("ctx")
    return getattr(ctx, "step", None), getattr(ctx, "microbatch", None)


class HookTracer:
    """Times every hook implementation of a :class:`PluginHost` and writes the trace.

    Build it with :meth:`install`; :meth:`close` restores the plugins' functions, removes the
    monitoring, writes and logs the summary, and returns it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a")
        self._stack: list[_Call] = []
        self._undo: list[Callable[[], None]] = []
        # (plugin, hook) -> [calls, seconds]; hook -> [calls, seconds] for whole hook calls.
        self._by_plugin: dict[tuple[str, str], list[float]] = {}
        self._by_hook: dict[str, list[float]] = {}

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
        record: dict[str, Any] = {
            "hook": call.hook,
            "step": call.step,
            "microbatch": call.microbatch,
            "ms": round(seconds * 1e3, 4),
            "plugins": [
                {"plugin": name, "ms": round(s * 1e3, 4), **({"wrapper": True} if w else {})}
                for name, s, w in call.plugins
            ],
        }
        if error is not None:
            record["error"] = type(error).__name__
        self._file.write(json.dumps(record) + "\n")
        _add(self._by_hook, call.hook, seconds)
        for name, s, _ in call.plugins:
            _add(self._by_plugin, (name, call.hook), s)

    def _timed(self, impl: Implementation, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` wrapped to add its running time to the current call of its hook."""
        hook, plugin, wrapper = impl.hook, impl.plugin, impl.wrapper
        ctx_index = impl.argnames.index("ctx") if "ctx" in impl.argnames else None

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            # NOTE: PluginHost.call_each calls implementations directly, not through pluggy's
            # monitored call: each such call becomes a call of its own in the trace.
            direct = not self._stack or self._stack[-1].hook != hook
            if direct:
                if ctx_index is not None and ctx_index < len(args):
                    kwargs_with_ctx = {"ctx": args[ctx_index]}
                else:
                    kwargs_with_ctx = kwargs
                self._stack.append(_Call(hook, *_position(kwargs_with_ctx)))
            entry = [plugin, 0.0, wrapper]
            self._stack[-1].plugins.append(entry)
            error = None
            start = time.perf_counter()
            try:
                result = function(*args, **kwargs)
                # A wrapper's function returns its generator; pluggy drives it later.
                return self._timed_generator(result, entry) if wrapper else result
            except BaseException as e:
                error = e
                raise
            finally:
                entry[1] += time.perf_counter() - start
                if direct:
                    self._finish(self._stack.pop(), error)

        return timed

    @staticmethod
    def _timed_generator(gen: Generator, entry: list[Any]) -> Generator:
        """Drive a wrapper implementation's generator for pluggy, adding to ``entry`` only the
        time the generator's own code runs (before and after its ``yield``), not the time it
        spends suspended while the wrapped implementations run (PEP 380's ``yield from``,
        written out so that each resumption is timed)."""
        send: Callable[[Any], Any] = gen.send
        arg: Any = None
        while True:
            start = time.perf_counter()
            try:
                value = send(arg)
            except StopIteration as stop:
                return stop.value
            finally:
                entry[1] += time.perf_counter() - start
            try:
                arg, send = (yield value), gen.send
            except GeneratorExit:
                gen.close()
                raise
            except BaseException as e:
                arg, send = e, gen.throw

    # ------------------------------------------------------------------ the end of the run

    def summary(self) -> dict[str, Any]:
        """Calls and milliseconds by plugin and hook, and of whole hook calls by hook."""
        plugins: dict[str, dict[str, dict[str, float]]] = {}
        for (plugin, hook), (calls, seconds) in sorted(self._by_plugin.items()):
            plugins.setdefault(plugin, {})[hook] = {"calls": calls, "ms": seconds * 1e3}
        hooks = {h: {"calls": c, "ms": s * 1e3} for h, (c, s) in sorted(self._by_hook.items())}
        return {"plugins": plugins, "hooks": hooks}

    def close(self) -> dict[str, Any]:
        """Stop tracing: restore the functions, write and log the summary, return it."""
        while self._undo:
            self._undo.pop()()
        summary = self.summary()
        self._file.write(json.dumps({"summary": summary}) + "\n")
        self._file.close()
        logger.info("time in hooks, by plugin (trace: %s)\n%s", self.path, format_summary(summary))
        return summary


def _add(table: dict, key: Any, seconds: float) -> None:
    counts = table.setdefault(key, [0, 0.0])
    counts[0] += 1
    counts[1] += seconds


def format_summary(summary: Mapping[str, Any]) -> str:
    """The summary as a table: one row per plugin and hook, a total per plugin, and the time of
    whole hook calls (implementations plus pluggy's dispatch)."""
    rows = [("plugin", "hook", "calls", "total ms", "mean ms")]

    def row(plugin: str, hook: str, calls: float, ms: float) -> None:
        mean = ms / calls if calls else 0.0
        rows.append((plugin, hook, f"{calls:.0f}", f"{ms:.3f}", f"{mean:.4f}"))

    for plugin, hooks in summary["plugins"].items():
        for hook, t in hooks.items():
            row(plugin, hook, t["calls"], t["ms"])
        if len(hooks) > 1:
            row(plugin, "(all)", *(sum(t[k] for t in hooks.values()) for k in ("calls", "ms")))
    hook_calls = summary["hooks"].values()
    row("(hook calls)", "(all)", *(sum(t[k] for t in hook_calls) for k in ("calls", "ms")))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join(
        "  "
        + "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    )
