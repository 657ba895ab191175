"""The commands of `mrlx`: the product's own (`engine`, `rollout`, `check`, `coordinator`), and
those another installed package adds through the entry-point group `mrlx_plugin.commands` (the
lab, `mrlx_lab`, adds `demo`, `bench` and `stub-engine`).

An entry point names a `Command`, or a plain `main(argv) -> int` whose docstring's first line is
its help. The product never imports such a package by name: a command whose package is not
installed (or does not import) is simply absent, and none may take a built-in command's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

ENTRY_POINT_GROUP = "mrlx_plugin.commands"


@dataclass(frozen=True)
class Command:
    """One `mrlx` subcommand: `run(argv)` returns the exit status; `help` is its line in `mrlx
    --help`. A command that `serves` until SIGTERM/SIGINT handles those signals itself (a graceful
    shutdown) and starts nothing, so `mrlx` leaves its signals alone."""

    run: Callable[[list[str]], int]
    help: str
    serves: bool = False


def _engine(argv: list[str]) -> int:
    from mrlx_plugin.local.engine.command import main

    return main(argv)


def _coordinator(argv: list[str]) -> int:
    from mrlx_plugin.coordinator.server import main

    return main(argv)


def _rollout(argv: list[str]) -> int:
    from mrlx_plugin.cli.run_episodes import main

    return main(argv)


def _check(argv: list[str]) -> int:
    from mrlx_plugin.cli.check import main

    return main(argv)


BUILT_IN: dict[str, Command] = {
    "engine": Command(
        _engine, "serve a small transformers model over the SGLang HTTP protocol (CPU)", serves=True
    ),
    "rollout": Command(
        _rollout, "run N episodes of a system against engines; print a summary; write samples as JSONL"
    ),
    "check": Command(_check, "validate configs (and two jobs' configs against each other); reach every URL"),
    "coordinator": Command(_coordinator, "the durable coordinator of a multi-model run", serves=True),
}


def _as_command(entry: metadata.EntryPoint) -> Command | None:
    """The command an entry point names; None when its package is missing or names no command."""
    try:
        found = entry.load()
    except ImportError:
        return None
    if isinstance(found, Command):
        return found
    if callable(found):
        help_text = ((getattr(found, "__doc__", None) or "").strip().splitlines() or [""])[0]
        return Command(found, help_text)
    return None


def registered(name: str | None = None) -> dict[str, Command]:
    """The commands installed packages add (all, or the one called `name`), in the order their
    entry points are found; never one with a built-in command's name."""
    found: dict[str, Command] = {}
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name in BUILT_IN or entry.name in found or name not in (None, entry.name):
            continue
        command = _as_command(entry)
        if command is not None:
            found[entry.name] = command
    return found


def find(name: str) -> Command | None:
    """The command called `name`: a built-in one, else one an installed package adds."""
    return BUILT_IN.get(name) or registered(name).get(name)


def every_command() -> dict[str, Command]:
    """Every command `mrlx` offers: the built-in ones, then those installed packages add."""
    return {**BUILT_IN, **registered()}
