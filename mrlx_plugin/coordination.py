"""Keeping the jobs of a multi-model run in step, through the coordinator.

The job that runs the episodes (the initiator) trains its own agent on the samples the host gets
back, and hands every other trainable agent's samples to the coordinator:
- `PeerOutbox` holds those samples until the host's rollout returns, then commits, for each
  prompt group the host kept for this step, the group's samples for each agent in one request.
  A group reaches the peer whole (an ABORTED sample, with zero loss mask, stands in for an
  episode that did not finish), so the peer's GRPO groups are the initiator's prompt groups and
  each peer step trains on one initiator step. Evaluation sends nothing.
- `initiator_barrier` runs at the top of each of the initiator's rollouts (right after its
  trainer pushed new weights): it reports this job's version and waits until every other
  trainable agent is within `coordinator.max_staleness` versions.

The job of a peer agent (a responder) never runs episodes: `responder_take` reports its version,
acknowledges what it trained in the previous step, and leases whole groups for this step.
Leases are renewed while the step trains, so a crash of the responder hands its groups back
after one lease period, and a slow step keeps them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .config import ConfigError
from .coordinator.client import CoordinatorClient, CoordinatorError, token_from_env_or_file
from .coordinator.wire import item_from_sample, sample_from_item

logger = logging.getLogger(__name__)


def make_client(runtime: Any) -> CoordinatorClient:
    c = runtime.settings.coordinator
    if not c.url:
        raise ConfigError(f"{runtime.source}: mrlx.coordinator.url is not set; a multi-model job needs the coordinator")
    if runtime.settings.self_agent is None:
        raise ConfigError(f"{runtime.source}: mrlx.self is not set; name the agent this job trains")
    try:
        token = token_from_env_or_file(c.token_env, c.token_file)
    except ValueError as exc:
        raise ConfigError(f"{runtime.source}: mrlx.coordinator.token_file: {exc}") from None
    return CoordinatorClient(c.url, run_id=runtime.settings.run_id, agent=runtime.settings.self_agent, token=token,
                             request_timeout_s=c.request_timeout_s, commit_deadline_s=c.wait_deadline_s)


@dataclass
class _Group:
    episodes: int = 0
    samples: dict[str, list[tuple[str, Any]]] = field(default_factory=dict)  # agent -> [(key, sample)]


class PeerOutbox:
    """Other agents' samples of this job's episodes, committed per prompt group at rollout end.

    The generate function adds each episode's samples for other agents as soon as its rewards are
    known. When the host's rollout returns, `drain` commits the groups the host kept for this
    job's step, each in one request, and drops the rest (groups the host over-sampled and then
    filtered out or aborted): so every peer gets exactly this step's prompt groups, one step's
    worth per step, and its queue does not grow with the host's over-sampling.
    """

    def __init__(self, runtime: Any):
        self.runtime = runtime
        self.groups: dict[Any, _Group] = {}
        self.stats = self._zero()

    @staticmethod
    def _zero() -> dict[str, int]:
        return {"groups_sent": 0, "samples_sent": 0, "groups_not_kept": 0, "groups_all_aborted": 0, "duplicates": 0}

    def add(self, episode: Any, peer_samples: dict[str, list[Any]]) -> None:
        """Record one ended episode's samples for other agents (rewards are final by now)."""
        group = self.groups.setdefault(episode.sample.group_index, _Group())
        group.episodes += 1
        for agent, samples in peer_samples.items():
            bucket = group.samples.setdefault(agent, [])
            for i, s in enumerate(samples):
                bucket.append((f"{episode.id}:{agent}:{i}", s))

    async def _send(self, group_index: Any, group: _Group, step: int) -> list[str]:
        producer = self.runtime.settings.self_agent
        failures = []
        for agent, keyed in group.samples.items():
            if all(getattr(s, "remove_sample", False) for _, s in keyed):
                # Sent all the same (zero loss masks train nothing): the peer leases one step's
                # groups per step, and a missing group would pull the next step's into this one.
                self.stats["groups_all_aborted"] += 1
            name = f"{producer}:{group_index}"
            items = [item_from_sample(s, key=k, group=name, group_size=len(keyed), producer=producer, step=step)
                     for k, s in keyed]
            try:
                result = await self.runtime.coordinator.commit(agent, items)
            except CoordinatorError as exc:
                failures.append(f"group {name} for {agent!r}: {exc}")
                continue
            self.stats["groups_sent"] += 1
            self.stats["samples_sent"] += result.accepted
            self.stats["duplicates"] += result.duplicates
        return failures

    async def drain(self, step: int, kept: set[Any] | None) -> dict[str, float]:
        """Commit the groups in `kept` (all when None), drop the others; raise if a commit failed.

        Commits retry through coordinator restarts and backpressure until their deadline; a
        group that still cannot be committed fails the rollout loudly rather than vanishing.
        """
        groups, self.groups = self.groups, {}
        chosen = {k: g for k, g in groups.items() if kept is None or k in kept}
        self.stats["groups_not_kept"] += len(groups) - len(chosen)
        results = await asyncio.gather(*(self._send(k, g, step) for k, g in chosen.items()))
        failures = [f for r in results for f in r]
        step_stats = {f"coordinator/{k}": float(v) for k, v in self.stats.items()}
        self.stats = self._zero()
        if failures:
            raise CoordinatorError(f"could not hand {len(failures)} group(s) to the coordinator: " + "; ".join(failures[:3]))
        return step_stats


async def initiator_barrier(runtime: Any, rollout_id: int) -> dict[str, float]:
    """Report this job's version; wait until every trainable peer is within the staleness bound."""
    c = runtime.settings.coordinator
    client = runtime.coordinator
    await client.heartbeat()
    await client.report_version(rollout_id)
    metrics: dict[str, float] = {}
    for agent in runtime.peer_agents():
        need = rollout_id - c.max_staleness
        started = time.monotonic()
        version = await client.wait_version(agent, need, deadline_s=c.wait_deadline_s) if need > 0 else (
            await client.get_version(agent) or 0)
        metrics[f"coordinator/wait_seconds/{agent}"] = time.monotonic() - started
        metrics[f"staleness/{agent}"] = float(rollout_id - version)
    return metrics


@dataclass
class ResponderState:
    leases: list[str] = field(default_factory=list)
    renewer: asyncio.Task | None = None


async def responder_take(runtime: Any, rollout_id: int, groups_needed: int) -> tuple[list[list[Any]], dict[str, float]]:
    """Ack last step's groups, report this job's version, and lease `groups_needed` whole groups."""
    c = runtime.settings.coordinator
    client = runtime.coordinator
    state: ResponderState = runtime.responder
    if state.renewer is not None:
        state.renewer.cancel()
        state.renewer = None
    expired = await _ack_all(client, state)  # the previous step has trained: its groups are done for good
    await client.heartbeat()
    await client.report_version(rollout_id)
    started = time.monotonic()
    deadline = started + c.wait_deadline_s
    groups: list[list[Any]] = []
    # This step's leases become the state's (to be acked once trained) only when the groups are
    # handed to the host: leases of a step that fails here are never acked, so they come back.
    leases: list[str] = []
    why = "the producer sent no more"
    while len(groups) < groups_needed:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CoordinatorError(
                f"step {rollout_id}: got {len(groups)} of {groups_needed} groups in {c.wait_deadline_s:.0f}s; {why}"
            )
        lease = await client.lease(groups_needed - len(groups), lease_s=c.lease_s, wait_s=min(30.0, remaining))
        why = lease.message or why
        if lease.lease_id and lease.groups:
            leases.append(lease.lease_id)
            groups.extend(lease.groups)
        if lease.end:
            break
    if not groups:
        raise CoordinatorError(f"step {rollout_id}: the producer ended the stream and no group is left to train on")
    samples = [[sample_from_item(item) for item in g] for g in groups]
    state.leases = leases
    state.renewer = asyncio.ensure_future(_renew(client, list(leases), c.lease_s))
    metrics = {"coordinator/wait_seconds": time.monotonic() - started, "coordinator/groups": float(len(groups)),
               "coordinator/acks_expired": float(expired)}
    versions = [_as_int(v) for g in samples for s in g for v in (s.weight_versions or [])]
    versions = [v for v in versions if v is not None]
    if versions:
        metrics[f"staleness/{runtime.settings.self_agent}"] = float(rollout_id - min(versions))
    return samples, metrics


async def responder_finish(runtime: Any) -> None:
    """Acknowledge the groups leased so far (their training is done and saved)."""
    state: ResponderState = runtime.responder
    if state.renewer is not None:
        state.renewer.cancel()
        state.renewer = None
    await _ack_all(runtime.coordinator, state)


async def _ack_all(client: CoordinatorClient, state: ResponderState) -> int:
    """Ack the state's leases; returns how many had expired already (409: their groups were
    handed out again and will be trained again, so delivery stays at least once)."""
    expired = 0
    for lease_id in state.leases:
        try:
            await client.ack(lease_id)
        except CoordinatorError as exc:
            if exc.status not in (404, 409):
                raise
            expired += 1
            logger.warning("lease %s could not be acked (%s); its groups were leased again after it expired. "
                           "Raise mrlx.coordinator.lease_s if training a step takes longer", lease_id, exc)
    state.leases = []
    return expired


async def _renew(client: CoordinatorClient, leases: list[str], lease_s: float) -> None:
    """Keep this step's leases while it trains (a dead responder stops renewing; its groups return)."""
    while True:
        await asyncio.sleep(max(1.0, lease_s / 3))
        for lease_id in leases:
            try:
                await client.extend(lease_id, lease_s)
            except CoordinatorError as exc:
                logger.warning("could not renew lease %s: %s", lease_id, exc)


def _as_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
