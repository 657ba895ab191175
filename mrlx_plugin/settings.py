"""The sections of a job's settings beside the core's: each registered system's, and the embedded
trainer's.

`mrlx_plugin.core.config` holds the core's own sections (run id, agents, engine, rewards,
coordinator) and the one parser, `parse_settings`, which reads exactly the sections it is given;
each agent system declares the model of its own section (`System.settings`, the key `mrlx.NAME`).
Whoever builds a job's settings gives the sections, from `job_sections`: the runtime (the systems
its config's plugins register), `mrlx check` and the embedded trainer (those systems and the
trainer's section). The settings then hold one typed field per system that declares a model
(`settings.pipeline`, `settings.game`), its checks between sections included.

`mrlx.trainer`, the embedded CPU trainer's section, belongs to that trainer
(`mrlx_plugin.local.trainer.settings`), which this layer does not import: a job that does not read
it (a slime job) accepts the section as it is; one that does names its model (`read_here`; a host
playing slime's part puts it on `args.mrlx_sections`, which the runtime passes on).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from types import MappingProxyType

from pydantic import BaseModel, ConfigDict

from mrlx_plugin.core.config import ConfigError, Section, Settings
from mrlx_plugin.episodes import Registered, System
from mrlx_plugin.plugins import collect_systems, make_plugin_manager


class UnreadTrainerSection(Section):
    """The embedded CPU trainer's section where its model is not given: any keys, unread (a slime
    job uses its own flags)."""

    model_config = ConfigDict(extra="allow")
    about = "the embedded CPU trainer only (slime jobs use their own flags)"


# Sections of the file that another part of the package reads, by key, as a job that does not read
# them takes them: unread.
READ_ELSEWHERE: Mapping[str, type[BaseModel]] = MappingProxyType({"trainer": UnreadTrainerSection})


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


def job_sections(
    systems: Mapping[str, Registered] | None = None, read_here: Mapping[str, type[BaseModel]] | None = None
) -> dict[str, type[BaseModel]]:
    """The sections of a job's settings beside the core's, for
    `parse_settings(..., sections=job_sections(...))`: the section of each of `systems` (default:
    the built-in ones, `built_in_systems()`) that declares a model, those read elsewhere
    (`READ_ELSEWHERE`, unread), and `read_here` (key -> model: the sections this process reads
    itself, the embedded trainer's `mrlx.trainer`) added or put in their place."""
    chosen = system_sections(built_in_systems() if systems is None else systems)
    return {**chosen, **READ_ELSEWHERE, **(read_here or {})}
