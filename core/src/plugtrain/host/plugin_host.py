"""Plugin discovery, loading and registration, and the firing of hooks for their answers.

Plugins are distributions that declare an entry point in the ``plugtrain.plugins`` group; the
entry point's name is the plugin's name. A run enables plugins by name
(``[plugins] enabled = [...]``) and only those are imported: the rest are known by their
metadata alone. An entry point names a module (registered as is) or a zero-argument callable,
usually a class, whose result is registered (so a plugin can keep per-run state on ``self``).
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import inspect
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

from plugtrain import API_VERSION, PROJECT_NAME, hookspecs
from plugtrain.errors import PluginError, UserError, did_you_mean, one_line

if TYPE_CHECKING:
    from plugtrain.plugin import SetupContext

ENTRY_POINT_GROUP = "plugtrain.plugins"


@dataclass(frozen=True)
class Implementation:
    """One plugin's implementation of one hook, as the hook tracer sees it."""

    hook: str
    plugin: str
    wrapper: bool
    """A new-style (``wrapper=True``) or old-style (``hookwrapper=True``) wrapper."""


@dataclass(frozen=True)
class InstalledPlugin:
    """An installed plugin as its metadata describes it (nothing imported)."""

    name: str
    value: str
    """The entry point's target, ``module`` or ``module:attr``."""
    distribution: str
    version: str
    entry_point: md.EntryPoint


def installed_plugins() -> dict[str, list[InstalledPlugin]]:
    """Every plugin installed in this environment, by name, read from metadata only.

    Each name maps to every distribution that provides it, in discovery order. More than one
    is a clash, reported only by a run that enables that name (:meth:`PluginHost.load_enabled`):
    the other plugins, and ``plugtrain plugins``, keep working.
    """
    found: dict[str, list[InstalledPlugin]] = {}
    for ep in md.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist
        plugin = InstalledPlugin(
            name=ep.name,
            value=ep.value,
            distribution=dist.name if dist else "?",
            version=dist.version if dist else "?",
            entry_point=ep,
        )
        providers = found.setdefault(ep.name, [])
        # One distribution seen twice (e.g. on two sys.path entries) is not a clash.
        if all(p.distribution != plugin.distribution for p in providers):
            providers.append(plugin)
    return found


def clash_error(name: str, providers: Sequence[InstalledPlugin]) -> PluginError:
    """The one-line error for plugin ``name``, which several distributions provide."""
    both = " and ".join(f"'{p.distribution}' {p.version}" for p in providers)
    return PluginError(
        f"plugin name '{name}' is provided by {both}: pip uninstall all but one of them, "
        f"or remove '{name}' from plugins.enabled"
    )


def _instantiate(plugin: InstalledPlugin, target: Any) -> Any:
    """A module is the plugin itself; a class or factory is called once to make it.

    A callable that needs arguments is the entry point's fault. An error raised while the call
    runs is the plugin's own (for instance a call of the plugin API written for another
    version of it): it is reported at the innermost line of the plugin's own code.
    """
    if not callable(target):
        return target
    try:
        inspect.signature(target).bind()
    except TypeError as e:
        raise PluginError(
            f"plugin '{plugin.name}': its entry point must name a module or a callable taking "
            f"no arguments, but '{plugin.value}' cannot be called without any: {e}"
        ) from e
    except ValueError:  # no signature to read (some builtins): calling it tells
        pass
    try:
        return target()
    except UserError:
        raise  # the plugin's own one-line error
    except Exception as e:
        where = _innermost_line_of(plugin.entry_point.module, e)
        raise PluginError(
            f"plugin '{plugin.name}' (distribution '{plugin.distribution}' {plugin.version}) "
            f"failed while '{plugin.value}' made it, at {where}: {one_line(e)} (fix the plugin, "
            f"or install a version of it written for plugtrain's plugin API "
            f"{'.'.join(map(str, API_VERSION))})"
        ) from e


def _innermost_line_of(module: str, error: BaseException) -> str:
    """``file:line`` of the innermost frame of ``error``'s traceback in the files of
    ``module``'s top-level package, else of the innermost frame."""
    top = sys.modules.get(module.partition(".")[0])
    file = getattr(top, "__file__", None)
    roots = [Path(p) for p in getattr(top, "__path__", [])] or ([Path(file)] if file else [])
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if any(Path(f.filename).is_relative_to(r) for r in roots)]
    frame = (own or frames)[-1]
    return f"{frame.filename}:{frame.lineno}"


class PluginHost:
    """The run's pluggy ``PluginManager``, with plugtrain's loading rules and error messages.

    ``host.hook.<name>(...)`` fires a hook for every registered plugin;
    ``host.results(<name>, ...)`` fires a result hook (:data:`plugtrain.hookspecs.RESULT_HOOKS`)
    and returns the answers by plugin name.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.hook = self.pm.hook
        self.versions: dict[str, str] = {}
        """The enabled plugins' ``distribution version``, by name, for the run's records."""
        self.inactive: dict[str, str] = {}
        """Plugins that deactivated themselves in ``setup``, by name, with their reason."""
        self._named: dict[str, tuple[list[pluggy.HookImpl], list[pluggy.HookImpl]]] = {}
        """Each result hook's registered implementations, and the stand-ins :meth:`results`
        runs for them."""

    def load_enabled(self, names: Sequence[str]) -> None:
        """Import and register the installed plugins named in ``names``, and only those."""
        installed = installed_plugins()
        for name in names:
            if name not in installed:
                available = ", ".join(sorted(installed)) or "none"
                raise PluginError(
                    f"plugins.enabled names '{name}', which no installed plugin provides"
                    f"{did_you_mean(name, installed)}; installed plugins: {available} "
                    f"(install the plugin's distribution, or remove '{name}' from plugins.enabled)"
                )
            if len(installed[name]) > 1:
                raise clash_error(name, installed[name])
            (plugin,) = installed[name]
            try:
                target = plugin.entry_point.load()
            except Exception as e:
                raise PluginError(
                    f"plugin '{name}' (distribution '{plugin.distribution}' {plugin.version}) "
                    f"failed to import '{plugin.value}': {type(e).__name__}: {e} "
                    f"(reinstall '{plugin.distribution}' or remove '{name}' from plugins.enabled)"
                ) from e
            self.register(_instantiate(plugin, target), name)
            self.versions[name] = f"{plugin.distribution} {plugin.version}"

    def register(self, plugin: object, name: str) -> None:
        """Register one plugin object under ``name`` and check its hooks against the contract."""
        if self.pm.has_plugin(name):
            raise PluginError(f"plugin '{name}' is enabled twice: list it once in plugins.enabled")
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as e:
            raise PluginError(f"plugin '{name}': {one_line(e)}") from e
        problem = self._contract_problem(plugin)
        if problem is not None:
            self.pm.unregister(plugin)
            raise PluginError(f"plugin '{name}' {problem}")

    def _contract_problem(self, plugin: object) -> str | None:
        """What breaks the contract in registered ``plugin``'s hooks, or None."""
        hooks = self.hook_names()
        for caller in self.pm.get_hookcallers(plugin) or []:
            if caller.name not in hooks:
                return (
                    f"implements hook '{caller.name}', which does not exist"
                    f"{did_you_mean(caller.name, hooks)}; hooks: {', '.join(hooks)}"
                )
            if caller.name in hookspecs.RESULT_HOOKS and any(
                impl.plugin is plugin and (impl.wrapper or impl.hookwrapper)
                for impl in caller.get_hookimpls()
            ):
                return (
                    f"implements result hook '{caller.name}' as a wrapper, which would see the "
                    "other plugins' answers: drop wrapper=True/hookwrapper=True from its hookimpl"
                )
        return None

    def results(self, hook_name: str, **kwargs: Any) -> dict[str, Any]:
        """Fire result hook ``hook_name``; return each plugin's non-None answer by plugin name.

        The implementations run, and the answers come, in the order of the plugins' names.
        The call goes through pluggy's hook execution (``PluginManager._hookexec``, the one
        every ``HookCaller`` calls), so call monitoring (the hook trace, the kit's cost counts)
        sees it like any other hook call. It runs, instead of the registered implementations,
        one stand-in per implementation (a ``HookImpl`` of the same plugin, made once while the
        registrations stay the same) whose function calls the registered one (the plugin's, or
        the tracer's around it) and pairs its answer with the plugin's name: nothing registered
        is rewritten. ``register`` refuses wrappers of result hooks.
        """
        if hook_name not in hookspecs.RESULT_HOOKS:
            raise ValueError(f"'{hook_name}' is not a result hook: fire it through host.hook")
        impls = self._impls(hook_name)
        registered, named = self._named.get(hook_name, (None, []))
        if registered != impls:
            # pluggy calls the last implementation of its list first.
            by_name = sorted(impls, key=lambda impl: impl.plugin_name, reverse=True)
            named = [pluggy.HookImpl(i.plugin, i.plugin_name, _named(i), i.opts) for i in by_name]
            self._named[hook_name] = (impls, named)
        answers = self.pm._hookexec(hook_name, named, kwargs, False)
        return {name: answer for name, answer in answers if answer is not None}

    def hooks_of(self, name: str) -> list[str]:
        """The hooks plugin ``name`` implements, in the contract's declaration order."""
        order = self.hook_names()
        callers = self.pm.get_hookcallers(self.get(name)) or []
        return sorted((caller.name for caller in callers), key=order.index)

    @staticmethod
    def hook_names() -> list[str]:
        """Every hook of the contract, in declaration order."""
        return [n for n, f in vars(hookspecs).items() if hasattr(f, f"{PROJECT_NAME}_spec")]

    def names(self) -> list[str]:
        """Names of the registered plugins."""
        return [name for name, _ in self.pm.list_name_plugin()]

    def get(self, name: str) -> object:
        """The registered plugin object called ``name``."""
        plugin = self.pm.get_plugin(name)
        if plugin is None:
            raise KeyError(name)
        return plugin

    def report(self) -> dict[str, dict[str, str]]:
        """Each enabled plugin's distribution and version, and ``inactive``: the reason, for
        one that deactivated itself in ``setup`` (for the run's records)."""
        report = {name: {"distribution": version} for name, version in self.versions.items()}
        for name, reason in self.inactive.items():
            report.setdefault(name, {"distribution": "?"})["inactive"] = reason
        return report

    def unregister(self, plugin: object) -> None:
        """Remove a plugin: none of its hooks fire afterwards."""
        self.pm.unregister(plugin)

    def name_of(self, plugin: object) -> str:
        """The name ``plugin`` is registered under: its entry point's name."""
        name = self.pm.get_name(plugin)
        if name is None:
            raise PluginError(f"{plugin!r} is not a registered plugin: register it first")
        return name

    def setup(self, ctx: SetupContext) -> None:
        """Fire ``setup``, then unregister the plugins that deactivated themselves in it."""
        self.hook.setup(ctx=ctx)
        for plugin, reason in ctx.deactivations.items():
            self.inactive[self.name_of(plugin)] = reason
            self.unregister(plugin)

    def implementers(self, hook_name: str) -> list[str]:
        """Names of the registered plugins that implement hook ``hook_name``, in call order."""
        return [impl.plugin_name for impl in reversed(self._impls(hook_name))]

    def call_one(self, name: str, hook_name: str, **kwargs: Any) -> None:
        """Fire hook ``hook_name`` for plugin ``name`` alone (``load_state_dict``, with that
        plugin's own state), through pluggy: its wrappers and call monitoring included."""
        if name not in self.implementers(hook_name):
            raise KeyError(f"plugin '{name}' does not implement '{hook_name}'")
        others = [plugin for other, plugin in self.pm.list_name_plugin() if other != name]
        self.pm.subset_hook_caller(hook_name, others)(**kwargs)

    def wrap_implementations(
        self, wrap: Callable[[Implementation, Callable[..., Any]], Callable[..., Any]]
    ) -> Callable[[], None]:
        """Replace every registered implementation's function by ``wrap(implementation,
        function)``; return a function that puts the originals back."""
        originals = []
        for hook_name in self.hook_names():
            for impl in self._impls(hook_name):
                described = Implementation(
                    hook_name,
                    impl.plugin_name,
                    bool(impl.wrapper or impl.hookwrapper),
                )
                originals.append((impl, impl.function))
                impl.function = wrap(described, impl.function)

        def unwrap() -> None:
            for impl, function in originals:
                impl.function = function

        return unwrap

    def monitor_calls(
        self,
        before: Callable[[str, dict[str, Any]], None],
        after: Callable[[str, BaseException | None], None],
    ) -> Callable[[], None]:
        """Call ``before(hook, kwargs)`` and ``after(hook, error)`` around every hook call
        fired through :attr:`hook`; return a function that stops it."""
        return self.pm.add_hookcall_monitoring(
            lambda hook, impls, kwargs: before(hook, kwargs),
            lambda outcome, hook, impls, kwargs: after(hook, outcome.exception),
        )

    def _impls(self, hook_name: str) -> list[pluggy.HookImpl]:
        return getattr(self.hook, hook_name).get_hookimpls()


def _named(impl: pluggy.HookImpl) -> Callable[..., tuple[str, Any]]:
    """A function taking ``impl``'s arguments that returns ``(plugin name, answer)``.

    It reads ``impl.function`` at each call, so that the hook tracer's wrapper, when installed,
    runs; ``functools.wraps`` gives it the parameters pluggy reads (through ``__wrapped__``).
    """

    @functools.wraps(impl.function)
    def named(*args: Any, **kwargs: Any) -> tuple[str, Any]:
        return impl.plugin_name, impl.function(*args, **kwargs)

    return named
