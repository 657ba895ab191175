"""Everything the rollout functions need, built once per process from the host's `args`.

The host calls the generate function thousands of times per step with the same `args`. The
`Runtime` for those args is built on the first call (off the event loop: loading tokenizers and
plugins blocks) and reused: settings, hooks, each agent's tokenizer and engine client, and the
host's limits. The host's `args` is only ever read. The Runtime of an `args` is kept by the
process registry (`core.host.HOST_PROCESS`), the one place flat host calls can find it again.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pluggy

from mrlx_plugin.core.config import (
    AgentSettings,
    ConfigError,
    Settings,
    parse_settings,
    raw_settings_from_args,
    read_text_setting,
)
from mrlx_plugin.core.engine_client import EngineClient
from mrlx_plugin.core.episode import GradeFailures
from mrlx_plugin.core.host import HOST_PROCESS, router_url
from mrlx_plugin.core.tokenizer import AgentTokenizer, TokenizerCache
from mrlx_plugin.hostcheck import check_rollout_mode, check_step_split
from mrlx_plugin.link.client import CoordinatorClient
from mrlx_plugin.link.peers import PeerOutbox, ResponderState, make_client, read_model_limits
from mrlx_plugin.plugins import FirstResult, SystemFn, collect_systems, make_plugin_manager, plugin_callers
from mrlx_plugin.rewards.grading import MathVerifier
from mrlx_plugin.rewards.shaping import math_verifier


@dataclass
class HostLimits:
    """The host's generation limits, as read from `args` (slime's flag names)."""

    max_context: int | None  # rollout_max_context_len (eval_max_context_len in evaluation)
    max_context_eval: int | None
    max_response: int | None  # rollout_max_response_len
    default_sampling: dict[str, Any]  # used when the host passes no sampling_params (CLI)
    # The host model's own position limit (`--max-position-embeddings`, else the checkpoint's
    # config.json): a longer sample has positions the trainer's model has no embedding for.
    model_max: int | None = None

    @classmethod
    def from_args(cls, args: Any) -> HostLimits:
        """Blocking (reads the checkpoint's config.json): called while the Runtime is built."""
        ctx = getattr(args, "rollout_max_context_len", None)
        model = read_model_limits(args, getattr(args, "hf_checkpoint", None))
        sampling = {
            "temperature": getattr(args, "rollout_temperature", 1.0),
            "top_p": getattr(args, "rollout_top_p", 1.0),
            "top_k": getattr(args, "rollout_top_k", -1),
            "max_new_tokens": getattr(args, "rollout_max_response_len", None) or 1024,
            "stop": getattr(args, "rollout_stop", None),
            "stop_token_ids": getattr(args, "rollout_stop_token_ids", None),
            "skip_special_tokens": getattr(args, "rollout_skip_special_tokens", False),
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        }
        return cls(
            max_context=ctx,
            max_context_eval=getattr(args, "eval_max_context_len", None) or ctx,
            max_response=getattr(args, "rollout_max_response_len", None),
            default_sampling={k: v for k, v in sampling.items() if v is not None},
            model_max=model.max_length,
        )


class Runtime:
    """Settings, hooks, tokenizers and engine clients of one rollout process.

    It owns what its episodes share: the agents' tokenizers (one per model and chat template),
    engine clients, the coordinator client, the peer outbox and responder state of a multi-model
    job, and the count of failed grades. The math verifier is the process's (`math_verifier`),
    shared with the `reward` function.
    """

    def __init__(
        self,
        args: Any,
        settings: Settings,
        pm: pluggy.PluginManager,
        source: str,
        base: Path | None = None,
        tokenizers: bool = True,
        systems: dict[str, SystemFn] | None = None,
        verifier: MathVerifier | None = None,
    ):
        self.args = args
        self.settings = settings
        self.pm = pm
        self.hooks = pm.hook
        # First-result hooks asked one plugin at a time: an awaited None defers, and the plugin
        # that answered is known (see plugins.FirstResult).
        self.grade_hook = FirstResult(pm, "mrlx_grade")
        self.shape_hook = FirstResult(pm, "mrlx_shape_rewards")
        self.turn_reward_hook = FirstResult(pm, "mrlx_turn_reward")
        for first_result in (self.grade_hook, self.shape_hook, self.turn_reward_hook):
            first_result.callers()  # built now: a plugin they cannot reach fails at start-up
        self.source = source
        self.limits = HostLimits.from_args(args)
        self.systems: dict[str, SystemFn] = systems if systems is not None else collect_systems(pm)
        self.system: SystemFn = self.systems[settings.system]
        # Samples per episode and agent: the system's transcripts per agent, times its turns per
        # transcript and the candidates per turn under per-turn credit.
        self.fan_out: dict[str, int] | None = samples_per_agent(self.system, settings, source)
        # Declared by the system (`run.team_shaping`), passed to the mrlx_shape_rewards hook.
        self.team_shaping = bool(getattr(self.system, "team_shaping", False))
        self.verifier = verifier if verifier is not None else MathVerifier()
        self.grade_failures = GradeFailures()
        self.system_prompts: dict[str, str | None] = {}
        self._tokenizer_cache = TokenizerCache()
        self.tokenizers: dict[str, AgentTokenizer] = {}
        self.clients: dict[str, EngineClient] = {}
        self.urls: dict[str, str] = {}
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
            self.system_prompts[name] = read_text_setting(
                agent.system_prompt, base, key=f"{source}: mrlx.agents.{name}.system_prompt"
            )
            if tokenizers:  # a responder job runs no episodes and may not have the others' tokenizers
                self.tokenizers[name] = self._load_tokenizer(name, agent, base)
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
        # opens each step on it.
        self.outbox = PeerOutbox(settings, source, peers) if peers else None
        self.responder = ResponderState()

    def samples_per_episode(self) -> int | None:
        """How many samples each episode returns to this job's trainer (None: it varies)."""
        if self.fan_out is None:
            return None
        return sum(n for agent, n in self.fan_out.items() if self.trains_here(agent))

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
        return [a for a, s in self.settings.agents.items() if s.trainable and not self.trains_here(a)]

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
        if self.responder.renewer is not None:  # it would keep renewing leases through a closed client
            self.responder.renewer.cancel()
            self.responder.renewer = None
        for client in set(self.clients.values()):
            await client.close()
        if self._coordinator is not None:
            await self._coordinator.close()
        await self.verifier.aclose()

    def callers_of(self, hook: str) -> list[tuple[str, Any]]:
        """(plugin name, a caller of that plugin's `hook` alone) for each plugin implementing it,
        in pluggy's list order: for systems that must say which plugin gave what."""
        return plugin_callers(self.pm, hook, call_order=False)

    def trains_here(self, agent: str) -> bool:
        """Whether this job's trainer trains `agent` (its samples go back to the host)."""
        a = self.settings.agents[agent]
        if self.settings.self_agent is not None:
            return agent == self.settings.self_agent
        return bool(a.trainable) and a.url == "self"

    def context_limit(self, agent: str, evaluation: bool = False) -> int | None:
        """The most tokens one sample of `agent` may hold (None: no limit known): the host's
        `--rollout-max-context-len` (`--eval-max-context-len` in evaluation) and, for an agent
        the host's model serves or trains, that model's position limit. A peer agent's samples
        are checked against its own model when they are committed (`PeerOutbox`)."""
        host = self.limits.max_context_eval if evaluation else self.limits.max_context
        on_host_model = self.settings.agents[agent].url == "self" or self.trains_here(agent)
        known = [n for n in (host, self.limits.model_max if on_host_model else None) if n is not None]
        return min(known) if known else None


def build_runtime(args: Any, tokenizers: bool = True) -> Runtime:
    raw, source, base = raw_settings_from_args(args)
    plugins = raw.get("plugins", []) if isinstance(raw, dict) else []
    if not isinstance(plugins, list):
        raise ConfigError(f"{source}: mrlx.plugins: expected a list of module names, got {plugins!r}")
    pm = make_plugin_manager(plugins, source=f"{source}: mrlx.plugins")
    systems = collect_systems(pm)
    settings = parse_settings(raw, source=source, known_systems=set(systems))
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
    runtime = Runtime(
        args, settings, pm, source, base, tokenizers=tokenizers, systems=systems, verifier=math_verifier(args)
    )
    check_rollout_mode(args, source, runtime.peer_agents())
    check_step_split(args, runtime.samples_per_episode(), settings.system, source)
    return runtime


def declared_counts(system: SystemFn, settings: Settings, source: str, what: str) -> dict[str, int] | None:
    """What `system` declares through its attribute `what` (see hookspecs.mrlx_register_systems):
    `fan_out(settings)`, transcripts per episode and agent (0 or more), or `turns(settings)`, the
    most model turns one transcript of an agent takes (1 or more); None when it declares none."""
    declare = getattr(system, what, None)
    if declare is None:
        return None
    counts = declare(settings)
    least, meaning = (
        (0, "transcripts per episode") if what == "fan_out" else (1, "the most turns one transcript takes")
    )
    if not isinstance(counts, dict) or not all(
        a in settings.agents and isinstance(n, int) and n >= least for a, n in counts.items()
    ):
        raise ConfigError(
            f"{source}: system {settings.system!r}: {what}(settings) returned {counts!r}; expected a mapping "
            "of "
            f"configured agents ({', '.join(settings.agents)}) to {meaning} ({least} or more)"
        )
    return counts


def samples_per_agent(system: SystemFn, settings: Settings, source: str) -> dict[str, int] | None:
    """Samples one episode returns per agent: the declared fan-out (transcripts), times, under
    `rewards.credit: turn`, the declared turns per transcript and `rewards.branch`."""
    transcripts = declared_counts(system, settings, source, "fan_out")
    if transcripts is None or settings.rewards.credit != "turn":
        return transcripts
    turns = declared_counts(system, settings, source, "turns")
    if turns is None:
        raise ConfigError(
            f"{source}: mrlx.rewards.credit is `turn`, but system {settings.system!r} declares no "
            "turns(settings) (the "
            "most model turns one transcript takes), so the samples of an episode cannot be counted; set "
            "`run.turns = lambda settings: {agent: n}` on its run function, or use credit: episode"
        )
    branch = settings.rewards.branch
    return {a: n * turns.get(a, 1) * branch for a, n in transcripts.items()}


def cached_runtime(args: Any) -> Runtime | None:
    """The Runtime of `args` if it was built, else None (never blocks)."""
    return HOST_PROCESS.cached(args, "runtime")


def runtime_for(args: Any, tokenizers: bool = True) -> Runtime:
    """The Runtime of `args`, built on first use (blocking: call from a thread or at start-up).

    `tokenizers=False` (a responder job) skips loading the agents' tokenizers."""
    return HOST_PROCESS.for_args(args, "runtime", lambda: build_runtime(args, tokenizers=tokenizers))


async def get_runtime(args: Any) -> Runtime:
    """`runtime_for` from async code: the first build runs in a thread so the loop keeps going."""
    rt = cached_runtime(args)
    if rt is not None:
        return rt
    return await asyncio.to_thread(runtime_for, args)
