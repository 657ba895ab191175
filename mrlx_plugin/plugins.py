"""Loading hook implementations: the package defaults, entry points, and modules from the config."""

from __future__ import annotations

import importlib
import inspect
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import pluggy

from mrlx_plugin import hookspecs
from mrlx_plugin.core.config import ConfigError

ENTRY_POINT_GROUP = hookspecs.PROJECT  # [project.entry-points.mrlx_plugin] in a user's package

SystemFn = Callable[[Any], Awaitable[None]]


def make_plugin_manager(modules: list[str], source: str = "mrlx.plugins") -> pluggy.PluginManager:
    """A plugin manager with the defaults, every `mrlx_plugin` entry point, and `modules`.

    Each entry of `modules` is a dotted module name importable in the rollout process (your
    repository on PYTHONPATH, or pip-installed). Errors name the entry and what to do.
    """
    from mrlx_plugin import defaults

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(defaults, name="mrlx_plugin.defaults")
    try:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    except Exception as exc:
        raise ConfigError(f"loading the '{ENTRY_POINT_GROUP}' entry points failed: {exc}") from exc
    for i, name in enumerate(modules):
        where = f"{source}[{i}]"
        if not isinstance(name, str) or not name:
            shown = repr(name) if len(repr(name)) <= 200 else repr(name)[:200] + "..."
            raise ConfigError(f"{where}: expected a dotted module name, got {shown}")
        if pm.get_plugin(name) is not None:
            continue
        module = _import(name, where)
        try:
            pm.register(module, name=name)
        except pluggy.PluginValidationError as exc:
            raise ConfigError(f"{where}: {name!r} has an invalid hook implementation: {exc}") from None
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        known = ", ".join(sorted(n for n in dir(hookspecs) if n.startswith("mrlx_")))
        raise ConfigError(f"{source}: {exc} (known hooks: {known})") from None
    return pm


def _import(name: str, where: str) -> Any:
    """Import a hook module named in the config; any failure is one ConfigError naming the entry,
    the module and, for an error inside the module, the file and line."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if not missing or name == missing or name.startswith(missing + "."):  # the module (or its package)
            raise ConfigError(
                f"{where}: cannot import {name!r} ({exc}); put its repository on PYTHONPATH of the rollout "
                'process (slime: ray job submit --runtime-env-json \'{"env_vars": {"PYTHONPATH": ...}}\')'
            ) from None
        raise ConfigError(
            f"{where}: importing {name!r} failed{_place(exc)}: it imports {missing!r}, which is not "
            f"installed ({exc}); install it where the rollout process runs"
        ) from None
    except SyntaxError as exc:
        place = f" ({exc.filename}, line {exc.lineno})" if exc.filename else ""
        raise ConfigError(f"{where}: {name!r} has a syntax error{place}: {exc.msg}; fix the module") from None
    except Exception as exc:  # noqa: BLE001 - whatever a user's module raises while it is imported
        raise ConfigError(
            f"{where}: importing {name!r} raised {type(exc).__name__}{_place(exc)}: {exc}; fix the module"
        ) from None


def _place(exc: BaseException) -> str:
    """Where in the user's code an exception was raised (the innermost frame outside importlib)."""
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if "importlib" not in f.filename and f.filename != __file__
    ]
    return f" at {frames[-1].filename}, line {frames[-1].lineno}" if frames else ""


def plugin_callers(pm: pluggy.PluginManager, hook: str, call_order: bool = True) -> list[tuple[str, Any]]:
    """One caller per plugin that implements `hook`: (plugin name, a hook caller that reaches that
    plugin's implementation alone), through the plugin manager (`subset_hook_caller`).

    `call_order`: in the order pluggy calls implementations (tryfirst, then the latest registered,
    ..., trylast); else in pluggy's list order (the package defaults, `trylast`, first). Wrappers
    are never left out: they wrap each plugin's call as they would wrap the whole call.
    """
    impls = [i for i in getattr(pm.hook, hook).get_hookimpls() if not (i.wrapper or i.hookwrapper)]
    if call_order:
        impls.reverse()  # pluggy calls the list from its end
    callers = []
    for impl in impls:
        if not hasattr(impl.plugin, hook):
            # subset_hook_caller leaves out plugins by the hook's attribute name: one that
            # implements the hook under another name (`specname`) could not be left out.
            raise ConfigError(
                f"{impl.plugin_name}: implements {hook} as {impl.function.__name__!r} (hookimpl specname); "
                f"name the function {hook}"
            )
        others = [other.plugin for other in impls if other is not impl]
        callers.append((impl.plugin_name, pm.subset_hook_caller(hook, remove_plugins=others)))
    return callers


class FirstResult:
    """A first-result hook, asked one plugin at a time in pluggy's call order.

    pluggy stops a first-result hook at the first implementation that returns something other
    than None, and an `async def` implementation returns a coroutine: called as a whole, the hook
    would stop there even when that coroutine's result is None, which is how an implementation
    defers. Asking one plugin at a time (each through `pm.subset_hook_caller`, never by calling
    an implementation's function) lets an awaited None defer to the next plugin as a returned
    None does, and tells which plugin gave the answer (for error messages).
    """

    def __init__(self, pm: pluggy.PluginManager, hook: str):
        self.pm = pm
        self.hook = hook
        self._seen: tuple[int, ...] = ()
        self._callers: list[tuple[str, Any]] = []

    def callers(self) -> list[tuple[str, Any]]:
        """The per-plugin callers, rebuilt when a plugin was registered or removed since."""
        seen = tuple(id(i) for i in getattr(self.pm.hook, self.hook).get_hookimpls())
        if seen != self._seen:
            self._callers, self._seen = plugin_callers(self.pm, self.hook), seen
        return self._callers

    def answer(self, **kwargs: Any) -> tuple[str | None, Any]:
        """(the plugin that answered, its result) for a hook whose results are not awaited;
        (None, None) when every plugin deferred."""
        for name, call in self.callers():
            result = call(**kwargs)
            if result is not None:
                return name, result
        return None, None

    def __call__(self, **kwargs: Any) -> Any:
        """The first result that is not None, awaiting awaitables: a plain value while every plugin
        asked answers synchronously (no coroutine, no task), else an awaitable of the answer."""
        callers = self.callers()
        for i, (_, call) in enumerate(callers):
            result = call(**kwargs)
            if result is None:
                continue
            if inspect.isawaitable(result):
                return self._finish(result, callers[i + 1 :], kwargs)
            return result
        return None

    def named(self, **kwargs: Any) -> Any:
        """As calling it, with the answer's producer: (the plugin that answered, its result), or an
        awaitable of that pair once a plugin answers with an awaitable; (None, None) when every
        plugin deferred. A value the caller refuses is then blamed on the plugin that gave it."""
        callers = self.callers()
        for i, (name, call) in enumerate(callers):
            result = call(**kwargs)
            if result is None:
                continue
            if inspect.isawaitable(result):
                return self._finish_named(name, result, callers[i + 1 :], kwargs)
            return name, result
        return None, None

    @staticmethod
    async def _finish_named(
        name: str, pending: Awaitable[Any], rest: list[tuple[str, Any]], kwargs: dict[str, Any]
    ) -> tuple[str | None, Any]:
        result = await pending
        for other, call in rest:
            if result is not None:
                break
            name, result = other, call(**kwargs)
            if inspect.isawaitable(result):
                result = await result
        return (name, result) if result is not None else (None, None)

    @staticmethod
    async def _finish(pending: Awaitable[Any], rest: list[tuple[str, Any]], kwargs: dict[str, Any]) -> Any:
        result = await pending
        for _, call in rest:
            if result is not None:
                break
            result = call(**kwargs)
            if inspect.isawaitable(result):
                result = await result
        return result


def collect_systems(pm: pluggy.PluginManager) -> dict[str, SystemFn]:
    """Every agent system the plugins register, by name. Two registrations of one name is an error."""
    systems: dict[str, SystemFn] = {}
    owners: dict[str, str] = {}
    # One plugin at a time: the hook's combined result list drops Nones, so it cannot say which
    # plugin registered what.
    for plugin, call in plugin_callers(pm, "mrlx_register_systems", call_order=False):
        results = call()
        result = results[0] if results else None
        if result is None:
            continue
        if not isinstance(result, dict):
            raise ConfigError(f"{plugin}: mrlx_register_systems must return a dict of name -> async function")
        for name, fn in result.items():
            if name in systems:
                raise ConfigError(
                    f"agent system {name!r} is registered twice: by {owners[name]} and by {plugin}"
                )
            if not inspect.iscoroutinefunction(fn):
                raise ConfigError(f"{plugin}: system {name!r} must be an async function run(episode)")
            systems[name] = fn
            owners[name] = plugin
    return systems
