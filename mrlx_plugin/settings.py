"""The settings of a job: the core's sections with the section of each registered system.

`mrlx_plugin.core.config` holds the core's own sections (run id, agents, engine, rewards,
coordinator) and the parsing; each agent system declares the model of its own section
(`System.settings`, the key `mrlx.NAME`). This module joins them: `parse_settings` builds the
settings with one typed field per registered system that declares a model (`settings.pipeline`,
`settings.game`), its checks between sections included.

`mrlx.trainer`, the embedded CPU trainer's section, belongs to that trainer
(`mrlx_plugin.local.settings`), which this layer does not import: a process that has not loaded
it (a slime job) accepts the section as it is, one that has (the embedded trainer, `mrlx check`)
validates it with every other section (`register_section`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cache

from pydantic import BaseModel, ConfigDict

from mrlx_plugin.core import config
from mrlx_plugin.core.config import ConfigError, Section, Settings
from mrlx_plugin.episodes import Registered, System
from mrlx_plugin.plugins import collect_systems, make_plugin_manager


class UnreadTrainerSection(Section):
    """The embedded CPU trainer's section where its model is not loaded: any keys, unread (a
    slime job uses its own flags)."""

    model_config = ConfigDict(extra="allow")
    about = "the embedded CPU trainer only (slime jobs use their own flags)"


# Sections of the file that another part of the package reads, by key: accepted unread until
# that part registers its model (`register_section`).
READ_ELSEWHERE: dict[str, type[BaseModel]] = {"trainer": UnreadTrainerSection}


def register_section(key: str, model: type[BaseModel]) -> None:
    """Validate the section `key` of `READ_ELSEWHERE` with `model` in every parse of this process
    from now on; the part of the package that reads the section calls this when it loads."""
    if key not in READ_ELSEWHERE:
        raise ValueError(f"mrlx.{key} is no section read elsewhere (those: {', '.join(READ_ELSEWHERE)})")
    READ_ELSEWHERE[key] = model


@cache
def built_in_systems() -> dict[str, Registered]:
    """The systems registered without a config's plugins: the package's own (and those of the
    installed `mrlx_plugin` entry points)."""
    return collect_systems(make_plugin_manager([]))


def system_sections(systems: Mapping[str, Registered]) -> dict[str, type[BaseModel]]:
    """The typed sections of `systems` (name -> the model a `System` declares). A system without a
    model keeps its section in `settings.extra`."""
    sections: dict[str, type[BaseModel]] = {}
    taken = {f.alias or key for key, f in Settings.model_fields.items()} | set(READ_ELSEWHERE)
    for name, registered in systems.items():
        system = registered.value
        assert isinstance(system, System)  # collect_systems takes no other kind
        if system.settings is None:
            continue
        if not (isinstance(system.settings, type) and issubclass(system.settings, BaseModel)):
            raise ConfigError(
                f"{registered.plugin}: agent system {name!r} declares settings={system.settings!r}; "
                "expected a pydantic model (a subclass of mrlx_plugin.core.config.SystemSection)"
            )
        if name in taken or not name.isidentifier() or name.startswith("_"):
            raise ConfigError(
                f"{registered.plugin}: agent system {name!r} declares settings, so mrlx.{name} would be "
                "its section, but that is "
                + ("another section's key" if name in taken else "no Python name")
                + "; register the system under another name"
            )
        sections[name] = system.settings
    return sections


def all_sections(
    systems: Mapping[str, Registered] | None = None, sections: Mapping[str, type[BaseModel]] | None = None
) -> dict[str, type[BaseModel]]:
    """The sections of `systems` (default: `built_in_systems()`) and those read elsewhere, with
    `sections` (key -> model) added or put in their place."""
    chosen = system_sections(built_in_systems() if systems is None else systems)
    return {**chosen, **READ_ELSEWHERE, **(sections or {})}


def settings_model(
    systems: Mapping[str, Registered] | None = None, sections: Mapping[str, type[BaseModel]] | None = None
) -> type[Settings]:
    """The Settings model of `all_sections(systems, sections)`."""
    return config.settings_model(all_sections(systems, sections))


def parse_settings(
    data: object,
    source: str = "config",
    known_systems: set[str] | None = None,
    systems: Mapping[str, Registered] | None = None,
    sections: Mapping[str, type[BaseModel]] | None = None,
) -> Settings:
    """`mrlx_plugin.core.config.parse_settings` with the sections of `systems` (default: the
    built-in ones, `built_in_systems()`) and `sections`. `known_systems`: the names a config may
    select (None: not checked)."""
    return config.parse_settings(data, source, known_systems, all_sections(systems, sections))


def settings_from_yaml(
    path: str | os.PathLike,
    known_systems: set[str] | None = None,
    systems: Mapping[str, Registered] | None = None,
    sections: Mapping[str, type[BaseModel]] | None = None,
) -> Settings:
    """`parse_settings` of a YAML file's `mrlx` key."""
    return config.settings_from_yaml(path, known_systems, all_sections(systems, sections))
