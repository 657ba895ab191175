"""Loading hook implementations: the package defaults, entry points, and modules from the config."""

from __future__ import annotations

import importlib
import traceback
import types

import pluggy

from mrlx_plugin import hookspecs
from mrlx_plugin.core.config import ConfigError
from mrlx_plugin.episodes import FirstAnswer, Hooks, Registered, System

ENTRY_POINT_GROUP = hookspecs.PROJECT  # [project.entry-points.mrlx_plugin] in a user's package


DEFAULTS = "mrlx_plugin.defaults"  # the plugin name of the package's own implementations


def make_plugin_manager(modules: list[str], source: str = "mrlx.plugins") -> pluggy.PluginManager:
    """A plugin manager with the defaults, every `mrlx_plugin` entry point, and `modules`.

    Each entry of `modules` is a dotted module name importable in the rollout process (your
    repository on PYTHONPATH, or pip-installed). Errors name the entry and what to do.
    """
    from mrlx_plugin import defaults

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(defaults, name=DEFAULTS)
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


def _import(name: str, where: str) -> types.ModuleType:
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


def plugin_callers(
    pm: pluggy.PluginManager, hook: str, call_order: bool = True
) -> list[tuple[str, pluggy.HookCaller]]:
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


def resolve_first(pm: pluggy.PluginManager, hook: str) -> FirstAnswer:
    """First-result hook `hook`, resolved now: each implementing plugin's caller in pluggy's call
    order. A plugin registered later is not asked (plugins load once, before any episode)."""
    return FirstAnswer(hook, tuple(plugin_callers(pm, hook)))


def resolve_hooks(pm: pluggy.PluginManager) -> Hooks:
    """The hooks an episode calls, resolved once when the plugins have loaded."""
    return Hooks(
        grade=resolve_first(pm, "mrlx_grade"),
        shape_rewards=resolve_first(pm, "mrlx_shape_rewards"),
        turn_reward=resolve_first(pm, "mrlx_turn_reward"),
        should_stop=pm.hook.mrlx_should_stop,
        episode_end=pm.hook.mrlx_episode_end,
    )


def collect_registered(pm: pluggy.PluginManager, hook: str, what: str, kind: type) -> dict[str, Registered]:
    """Everything the plugins register through `hook` (each returns a dict of name -> `kind`), by
    name, with the plugin that registered it. One name registered twice is an error naming both
    plugins; so is a value of another kind. The one way systems and games are collected."""
    found: dict[str, Registered] = {}
    # One plugin at a time: the hook's combined result list drops Nones, so it cannot say which
    # plugin registered what.
    for plugin, call in plugin_callers(pm, hook, call_order=False):
        results = call()
        result = results[0] if results else None
        if result is None:
            continue
        if not isinstance(result, dict):
            raise ConfigError(f"{plugin}: {hook} must return a dict of name -> {what}")
        for name, value in result.items():
            if name in found and found[name].value is not value:
                raise ConfigError(
                    f"{what} {name!r} is registered twice: by {found[name].plugin} and by {plugin}"
                )
            if not isinstance(value, kind):
                raise ConfigError(
                    f"{plugin}: {what} {name!r} is a {type(value).__name__}; expected a {kind.__name__}"
                    + _MIGRATION.get(kind, "")
                )
            found.setdefault(name, Registered(name, value, plugin))
    return found


_MIGRATION: dict[type, str] = {
    System: " (wrap an async run function: `System(run=run, fan_out=lambda settings: {agent: n})`; see "
    "mrlx_plugin.episodes.system)"
}


def collect_systems(pm: pluggy.PluginManager) -> dict[str, Registered]:
    """Every agent system the plugins register (`mrlx_register_systems`), by name."""
    return collect_registered(pm, "mrlx_register_systems", "agent system", System)


def collect_games(pm: pluggy.PluginManager) -> dict[str, Registered]:
    """Every game the plugins register (`mrlx_register_games`), by name."""
    return collect_registered(pm, "mrlx_register_games", "game", object)
