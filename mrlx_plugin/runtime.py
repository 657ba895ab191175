"""Everything the rollout functions need, built once per process from the host's `args`.

The host calls the generate function thousands of times per step with the same `args`. The
`Runtime` for those args is built on the first call (off the event loop: loading tokenizers and
plugins blocks) and reused: settings, hooks, each agent's tokenizer and engine client, and the
host's limits. The host's `args` is only ever read. The Runtime of an `args` is kept by the
process registry (`core.host.HOST_PROCESS`), the one place flat host calls can find it again.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
from pathlib import Path
from typing import cast

import pluggy

from mrlx_plugin.agents.server import close_server as close_agent_server
from mrlx_plugin.core.config import (
    AgentSettings,
    ConfigError,
    Settings,
    parse_settings,
    raw_settings_from_args,
    read_text_setting,
)
from mrlx_plugin.core.engine_client import EngineClient
from mrlx_plugin.core.host import HOST_PROCESS, HostLimits, router_url
from mrlx_plugin.core.tokenizer import AgentTokenizer, TokenizerCache
from mrlx_plugin.episodes import Episode, EpisodeContext, Registered, start_system
from mrlx_plugin.episodes.samples import samples_of
from mrlx_plugin.episodes.system import HookUsers
from mrlx_plugin.hookspecs import hookimpl
from mrlx_plugin.hostcheck import check_rollout_mode, check_step_split, check_trained_adapters
from mrlx_plugin.link.client import CoordinatorClient
from mrlx_plugin.link.job import make_client
from mrlx_plugin.link.limits import read_model_limits
from mrlx_plugin.link.outbox import PeerOutbox
from mrlx_plugin.link.responder import Responder
from mrlx_plugin.plugins import (
    DEFAULTS,
    collect_games,
    collect_systems,
    make_plugin_manager,
    plugin_callers,
    resolve_hooks,
)
from mrlx_plugin.rewards.shaping import math_verifier
from mrlx_plugin.settings import job_sections


class Runtime:
    """Settings, hooks, tokenizers and engine clients of one rollout process.

    It owns what its episodes share: the agents' tokenizers (one per model and chat template),
    engine clients, the count of failed grades, and, in the job that runs a multi-model run's
    episodes, the coordinator client and the peer outbox. The math verifier is the process's
    (`math_verifier`), shared with the `reward` function.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        settings: Settings,
        pm: pluggy.PluginManager,
        source: str,
        base: Path | None = None,
        tokenizers: bool = True,
        systems: dict[str, Registered] | None = None,
    ):
        self.args = args
        self.settings = settings
        self.pm = pm
        self.source = source
        systems = systems if systems is not None else collect_systems(pm)
        games = collect_games(pm)
        self.system, per_episode = start_system(systems, games, settings, source, hook_users(pm))
        self.verifier = math_verifier(args)  # the process's, shared with the `reward` function
        self._tokenizer_cache = TokenizerCache()
        self.tokenizers: dict[str, AgentTokenizer] = {}
        self.clients: dict[str, EngineClient] = {}
        self.urls: dict[str, str] = {}
        system_prompts: dict[str, str | None] = {}
        self._base = base
        by_url: dict[tuple[str, str | None], EngineClient] = {}
        for name, agent in settings.agents.items():
            self.urls[name] = self._resolve_url(name, agent)
            key = self._api_key(name, agent)
            client = by_url.get((self.urls[name], key))
            if client is None:
                client = by_url[(self.urls[name], key)] = EngineClient(
                    self.urls[name], settings.engine, api_key=key
                )
            self.clients[name] = client
            system_prompts[name] = read_text_setting(
                agent.system_prompt, base, key=f"{source}: mrlx.agents.{name}.system_prompt"
            )
            if tokenizers:  # a responder job runs no episodes and may not have the others' tokenizers
                self.tokenizers[name] = self._load_tokenizer(name, agent, base)
        self.context = EpisodeContext(
            args=args,
            settings=settings,
            system=self.system,
            # First-result hooks resolved now, one plugin at a time: an awaited None defers, and
            # the plugin that answered is known (see episodes.context.FirstAnswer).
            hooks=resolve_hooks(pm),
            limits=HostLimits.from_args(args, read_model_limits(args, getattr(args, "hf_checkpoint", None))),
            tokenizers=self.tokenizers,
            clients=self.clients,
            urls=self.urls,
            system_prompts=system_prompts,
            samples_per_episode=per_episode,
            trained=frozenset(a for a in settings.agents if _trains_here(settings, a)),
            games=games,
        )
        self.limits = self.context.limits
        # Samples one episode returns per agent (None: they vary): the system's fan-out (transcripts),
        # under per-turn credit times its turns and `rewards.branch` (episodes.system.samples_per_agent).
        self.samples_per_episode = self.context.samples_per_episode
        peers = self.peer_agents()
        if peers and not settings.coordinator.url:
            raise ConfigError(
                f"{source}: mrlx.agents.{peers[0]} is trainable but not trained by this job (mrlx.self is "
                f"{settings.self_agent!r}); set mrlx.coordinator.url so its samples reach its trainer, or "
                "set "
                f"mrlx.agents.{peers[0]}.trainable: false"
            )
        self._coordinator: CoordinatorClient | None = None
        # Other jobs' agents' samples of this job's episodes; the initiator's rollout function
        # opens each step on it, and it observes every finished episode.
        self.outbox = PeerOutbox(settings, source, peers) if peers else None
        if self.outbox is not None:
            pm.register(_OutboxObserver(self.outbox), name="mrlx_plugin.link.outbox")
        # The step this job's rollout has opened (episodes starting now are born in it); None until
        # a rollout function opens one. Miles' `--fully-async` producer starts episodes before its
        # first step asks for groups: that step is open from the start.
        self.step: int | None = None
        if getattr(args, "fully_async", False):
            self.step = int(getattr(args, "start_rollout_id", 0) or 0)
            if self.outbox is not None:
                self.outbox.open_step(self.step)

    def trained_samples_per_episode(self) -> int | None:
        """How many samples each episode returns to this job's trainer (None: it varies)."""
        if self.samples_per_episode is None:
            return None
        return sum(n for agent, n in self.samples_per_episode.items() if self.trains_here(agent))

    def load_tokenizers(self) -> None:
        """Load the agents' tokenizers a responder's Runtime skipped (blocking; before episodes run
        on it, as a responder's evaluation does)."""
        for name, agent in self.settings.agents.items():
            if name not in self.tokenizers:
                self.tokenizers[name] = self._load_tokenizer(name, agent, self._base)

    @property
    def coordinator(self) -> CoordinatorClient:
        """This job's coordinator client (created on first use)."""
        if self._coordinator is None:
            self._coordinator = make_client(self.settings, self.source)
        return self._coordinator

    def peer_agents(self) -> list[str]:
        """Trainable agents that another job trains: their samples go through the coordinator."""
        return _peer_agents(self.settings)

    def _resolve_url(self, name: str, agent: AgentSettings) -> str:
        if agent.url != "self":
            return agent.url
        url = router_url(self.args)
        if url is None:
            raise ConfigError(
                f"{self.source}: mrlx.agents.{name}.url: 'self' means this job's router, but the host set no "
                "--sglang-router-ip/--sglang-router-port; set them, or give this agent an http:// URL"
            )
        return url

    def _api_key(self, name: str, agent: AgentSettings) -> str | None:
        if agent.api_key_env is None:
            return None
        key = os.environ.get(agent.api_key_env, "").strip()
        if not key:
            raise ConfigError(
                f"{self.source}: mrlx.agents.{name}.api_key_env: environment variable {agent.api_key_env} is "
                "not set "
                "in the rollout process; pass it through the job's runtime env"
            )
        return key

    def _load_tokenizer(self, name: str, agent: AgentSettings, base: Path | None) -> AgentTokenizer:
        path = agent.tokenizer or getattr(self.args, "hf_checkpoint", None)
        if not path:
            raise ConfigError(
                f"{self.source}: mrlx.agents.{name}.tokenizer: not set and the host gave no --hf-checkpoint; "
                "give the path of this agent's tokenizer"
            )
        template = read_text_setting(
            agent.chat_template, base, key=f"{self.source}: mrlx.agents.{name}.chat_template"
        )
        return self._tokenizer_cache.load(
            str(path), template, key_hint=f"{self.source}: mrlx.agents.{name}.tokenizer"
        )

    async def aclose(self) -> None:
        """Close this event loop's connections and the grading worker (CLI and tests; slime's
        rollout loop lives as long as the process). The worker starts again on the next grade."""
        responder = cached_responder(self.args)
        if responder is not None:  # a responder job's: it would keep renewing leases
            await responder.aclose()
        for client in set(self.clients.values()):
            await client.close()
        if self._coordinator is not None:
            await self._coordinator.close()
        await self.verifier.aclose()
        await close_agent_server()

    def trains_here(self, agent: str) -> bool:
        """Whether this job's trainer trains `agent` (its samples go back to the host)."""
        return self.context.trains_here(agent)


def _trains_here(settings: Settings, agent: str) -> bool:
    if settings.self_agent is not None:
        return agent == settings.self_agent
    a = settings.agents[agent]
    return bool(a.trainable) and a.url == "self"


def read_settings(
    args: argparse.Namespace,
) -> tuple[Settings, pluggy.PluginManager, dict[str, Registered], str, Path | None]:
    """The settings of `args` with the plugins they name and the systems those register, where the
    settings came from (for messages) and the folder their relative paths start from (blocking)."""
    raw, source, base = raw_settings_from_args(args)
    plugins = raw.get("plugins", []) if isinstance(raw, dict) else []
    if not isinstance(plugins, list):
        raise ConfigError(f"{source}: mrlx.plugins: expected a list of module names, got {plugins!r}")
    pm = make_plugin_manager(plugins, source=f"{source}: mrlx.plugins")
    systems = collect_systems(pm)
    settings = parse_settings(
        raw, source, set(systems), sections=job_sections(systems, getattr(args, "mrlx_sections", None))
    )
    return settings, pm, systems, source, base


def build_runtime(args: argparse.Namespace, tokenizers: bool = True) -> Runtime:
    settings, pm, systems, source, base = read_settings(args)
    if getattr(args, "apply_chat_template", False):
        raise ConfigError(
            f"{source}: the host was started with --apply-chat-template, so prompts arrive already "
            "templated; "
            "remove that flag: mrlx renders each agent's prompt with that agent's own chat template"
        )
    if getattr(args, "partial_rollout", False):
        raise ConfigError(
            f"{source}: --partial-rollout resumes one half-generated sample, but a multi-agent episode is "
            "many "
            "samples; remove --partial-rollout (aborted episodes are returned as ABORTED samples instead)"
        )
    runtime = Runtime(args, settings, pm, source, base, tokenizers=tokenizers, systems=systems)
    check_rollout_mode(args, source, runtime.peer_agents())
    check_trained_adapters(args, settings, sorted(runtime.context.trained), source)
    check_step_split(args, runtime.trained_samples_per_episode(), settings.system, source)
    return runtime


def hook_users(pm: pluggy.PluginManager) -> HookUsers:
    """The plugins other than the package's own defaults that implement a hook (what a system's
    start-up checks ask of the plugins: `episodes.system.start_system`)."""
    return lambda hook: {name for name, _ in plugin_callers(pm, hook)} - {DEFAULTS}


def cached_runtime(args: argparse.Namespace) -> Runtime | None:
    """The Runtime of `args` if it was built, else None (never blocks)."""
    return cast("Runtime | None", HOST_PROCESS.cached(args, "runtime"))


def runtime_for(args: argparse.Namespace, tokenizers: bool = True) -> Runtime:
    """The Runtime of `args`, built on first use (blocking: call from a thread or at start-up).

    `tokenizers=False` (a responder job) skips loading the agents' tokenizers."""
    return HOST_PROCESS.for_args(
        args, "runtime", lambda: _settled(build_runtime(args, tokenizers=tokenizers))
    )


def _settled(runtime: Runtime) -> Runtime:
    """`runtime`, once the objects alive now are kept out of the cycle collector's full passes.

    What exists once the Runtime is built lives as long as the process: the modules of torch,
    transformers and the tokenizers, the plugins, the engine clients (a few hundred thousand
    objects). Every full collection would walk them all again, ~0.15 s on one core, and one lands
    in most steps, stalling every episode of the rollout at once. Collected first, then frozen
    (`gc.freeze`): nothing that is garbage now is kept, and objects made later are collected as
    before. Once per process: the first Runtime's build."""
    if not _FROZEN:
        _FROZEN.append(True)
        gc.collect()
        gc.freeze()
    return runtime


_FROZEN: list[bool] = []


async def get_runtime(args: argparse.Namespace) -> Runtime:
    """`runtime_for` from async code: the first build runs in a thread so the loop keeps going."""
    rt = cached_runtime(args)
    if rt is not None:
        return rt
    return await asyncio.to_thread(runtime_for, args)


# ----------------------------------------------------------------------------------------------
# Multi-model jobs
# ----------------------------------------------------------------------------------------------


def _peer_agents(settings: Settings) -> list[str]:
    return [a for a, s in settings.agents.items() if s.trainable and not _trains_here(settings, a)]


class _OutboxObserver:
    """The initiator's outbox as a plugin: every finished episode goes to it (the link area does
    not know the hooks)."""

    def __init__(self, outbox: PeerOutbox):
        self.outbox = outbox

    # Last: observers of the package's users see the episode first, as before it reached the outbox.
    @hookimpl(trylast=True)
    def mrlx_episode_end(self, episode: Episode) -> None:
        self.outbox.episode_ended(episode, lambda agent: samples_of(episode, [agent], every_agent=True))


def build_responder(args: argparse.Namespace) -> Responder:
    """A responder job's link (blocking): its settings, the samples per episode and agent the
    system declares (the size of a step, and of the fillers for a group set aside), its model's
    limits and its coordinator client; no tokenizer, engine client or system prompt (it runs no
    episodes; its evaluation builds a Runtime)."""
    settings, pm, systems, source, _ = read_settings(args)
    # the checks start-up runs, and the samples per episode and agent
    _, per_episode = start_system(systems, collect_games(pm), settings, source, hook_users(pm))
    responder = Responder.for_job(settings, source, args, per_episode)
    check_rollout_mode(args, source, _peer_agents(settings))
    check_trained_adapters(args, settings, [responder.agent], source)
    check_step_split(
        args, None if per_episode is None else per_episode.get(responder.agent, 0), settings.system, source
    )
    return responder


def cached_responder(args: argparse.Namespace) -> Responder | None:
    """The Responder of `args` if it was built, else None (never blocks)."""
    return cast("Responder | None", HOST_PROCESS.cached(args, "responder"))


def responder_for(args: argparse.Namespace) -> Responder:
    """The Responder of `args`, built on first use (blocking: call from the rollout function)."""
    return HOST_PROCESS.for_args(args, "responder", lambda: build_responder(args))
