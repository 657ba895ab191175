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
                "process (slime: ray job submit --runtime-env-json '{\"env_vars\": {\"PYTHONPATH\": ...}}')"
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
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "importlib" not in f.filename and f.filename != __file__]
    return f" at {frames[-1].filename}, line {frames[-1].lineno}" if frames else ""


def collect_systems(pm: pluggy.PluginManager) -> dict[str, SystemFn]:
    """Every agent system the plugins register, by name. Two registrations of one name is an error."""
    systems: dict[str, SystemFn] = {}
    owners: dict[str, str] = {}
    impls = pm.hook.mrlx_register_systems.get_hookimpls()
    for impl in impls:
        result = impl.function()
        if result is None:
            continue
        if not isinstance(result, dict):
            raise ConfigError(f"{impl.plugin_name}: mrlx_register_systems must return a dict of name -> async function")
        for name, fn in result.items():
            if name in systems:
                raise ConfigError(
                    f"agent system {name!r} is registered twice: by {owners[name]} and by {impl.plugin_name}"
                )
            if not inspect.iscoroutinefunction(fn):
                raise ConfigError(f"{impl.plugin_name}: system {name!r} must be an async function run(episode)")
            systems[name] = fn
            owners[name] = impl.plugin_name
    return systems

