"""Loading hook implementations: the package defaults, entry points, and modules from the config."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import pluggy

from . import hookspecs
from .config import ConfigError

ENTRY_POINT_GROUP = hookspecs.PROJECT  # [project.entry-points.mrlx_plugin] in a user's package

SystemFn = Callable[[Any], Awaitable[None]]


def make_plugin_manager(modules: list[str], source: str = "mrlx.plugins") -> pluggy.PluginManager:
    """A plugin manager with the defaults, every `mrlx_plugin` entry point, and `modules`.

    Each entry of `modules` is a dotted module name importable in the rollout process (your
    repository on PYTHONPATH, or pip-installed). Errors name the entry and what to do.
    """
    from . import defaults

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
            raise ConfigError(f"{where}: expected a dotted module name, got {name!r}")
        if pm.get_plugin(name) is not None:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(
                f"{where}: cannot import {name!r} ({exc}); put its repository on PYTHONPATH of the rollout "
                "process (slime: ray job submit --runtime-env-json '{\"env_vars\": {\"PYTHONPATH\": ...}}')"
            ) from None
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

