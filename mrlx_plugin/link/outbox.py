"""The initiator's side of a multi-model run: other agents' samples out, the staleness bound in.

The job that runs the episodes (the initiator) trains its own agent on the samples the host gets
back, and hands every other trainable agent's samples to the coordinator:
- `PeerOutbox` observes every finished training episode (the runtime registers it on the
  `mrlx_episode_end` hook when the run has peer agents) and holds those samples until the host's
  rollout returns; it then commits, for each prompt group the host kept for this step, the
  group's samples for each agent in one request. A group reaches the peer whole (an ABORTED
  sample, with zero loss mask, stands in for an episode that did not finish, and for a sample the
  peer's model could not take: token ids outside its vocabulary, longer than its context), so the
  peer's GRPO groups are the initiator's prompt groups and each peer step trains on one initiator
  step. Evaluation sends nothing.
- `initiator_barrier` runs at the top of each of the initiator's rollouts (right after its
  trainer pushed new weights): it reports this job's version and waits until every other
  trainable agent is within `coordinator.max_staleness` versions.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

from mrlx_plugin.core.config import ConfigError
from mrlx_plugin.core.host import HostSample
from mrlx_plugin.link.client import CoordinatorClient, CoordinatorError
from mrlx_plugin.link.codec import filler_sample, item_from_sample
from mrlx_plugin.link.job import check_queue_depth, items_per_step
from mrlx_plugin.link.limits import ModelLimits, read_model_limits
from mrlx_plugin.link.wire import QueueItem, WireError, items_batch

if TYPE_CHECKING:
    from mrlx_plugin.core.config import Settings
    from mrlx_plugin.core.tokenizer import AgentTokenizer

logger = logging.getLogger(__name__)


class FinishedEpisode(Protocol):
    """What the outbox reads of a finished episode (the episodes area's `Episode`, which the link
    does not import)."""

    evaluation: bool
    id: str
    sample: HostSample  # the host's input sample: its `group_index` is the prompt group


@dataclass
class _Group:
    episodes: int = 0
    samples: dict[str, list[tuple[str, HostSample]]] = field(default_factory=dict)  # agent -> [(key, sample)]


class PeerOutbox:
    """Other agents' samples of this job's episodes, committed per prompt group at rollout end.

    It observes every finished episode (`episode_ended`, called through the `mrlx_episode_end`
    hook once the episode's rewards are final) and adds a training episode's samples for other
    agents into the step its rollout function opened (`open_step`: samples without an open step
    mean the job runs episodes outside `initiator_rollout`, which is refused). When the host's
    rollout returns, `drain` commits the groups the host kept for this job's step, each in one
    request, and drops the rest (groups the host over-sampled and then filtered out or aborted):
    so every peer gets exactly this step's prompt groups, one step's worth per step, and its queue
    does not grow with the host's over-sampling. A sample the peer's model could not take
    (`limits`, read once by the rollout function), or that the coordinator's frames cannot carry,
    is committed as an ABORTED filler instead, and counted.
    """

    def __init__(self, settings: Settings, source: str, peer_agents: Sequence[str]):
        self.settings = settings  # this job's: who produces (`self`), the coordinator's settings
        self.source = source
        self.peer_agents = list(peer_agents)  # trainable agents that other jobs train
        self.step: int | None = None  # the initiator's step its rollout function opened
        self.groups: dict[int | None, _Group] = {}  # by the prompt group (`group_index`)
        self.stats = self._zero()
        self.limits: dict[str, ModelLimits] = {}  # peer agent -> what its model takes
        self.pad_ids: dict[str, int] = {}
        self.depth_checked = False
        self.peer_versions: dict[str, int] = {}  # each peer's version as the last barrier saw it

    @staticmethod
    def _zero() -> dict[str, int]:
        return {
            "groups_sent": 0,
            "samples_sent": 0,
            "groups_not_kept": 0,
            "groups_all_aborted": 0,
            "duplicates": 0,
            "items_refused": 0,
            "stale": 0,
        }

    def open_step(self, step: int) -> None:
        """The initiator's rollout function has begun its step `step`: episodes may add samples.
        It stays open until the next step opens (episodes the host aborted may end after `drain`;
        their groups are not kept, and are dropped at the next drain)."""
        self.step = step

    def require_step(self) -> None:
        """Refuse training episodes whose peer samples would have no step to go to."""
        if self.step is None:
            raise ConfigError(
                f"{self.source}: this job's episodes have samples for {', '.join(self.peer_agents)}, "
                "trained by other jobs, but no step is open: episodes ran outside "
                "mrlx_plugin.rollout.initiator_rollout; set --rollout-function-path "
                "mrlx_plugin.rollout.initiator_rollout"
            )

    def load_limits(self, args: argparse.Namespace, tokenizers: Mapping[str, AgentTokenizer]) -> None:
        """Read each peer's limits (blocking: from the rollout function, before its loop runs):
        its model's config next to its tokenizer (or `args.hf_checkpoint`), else the tokenizer's
        vocabulary."""
        for agent in self.peer_agents:
            if agent in self.limits:
                continue
            settings = self.settings.agents[agent]
            tokenizer = tokenizers.get(agent)
            path = settings.tokenizer or getattr(args, "hf_checkpoint", None)
            self.limits[agent] = read_model_limits(None, path, getattr(tokenizer, "vocab_size", None))
            eos = getattr(tokenizer, "eos_token_id", None)
            self.pad_ids[agent] = eos if isinstance(eos, int) and eos >= 0 else 0

    def episode_ended(self, episode: FinishedEpisode, samples_for: Callable[[str], list[HostSample]]) -> None:
        """Take a finished episode's samples for the peer agents (its rewards are final):
        `samples_for(agent)` builds them. An evaluation episode sends nothing to other jobs."""
        if episode.evaluation:
            return
        self.add(episode.sample.group_index, episode.id, {a: samples_for(a) for a in self.peer_agents})

    def add(
        self, group_index: int | None, episode_id: str, peer_samples: dict[str, list[HostSample]]
    ) -> None:
        """Record one ended episode's samples for other agents (rewards are final by now)."""
        self.require_step()
        group = self.groups.setdefault(group_index, _Group())
        group.episodes += 1
        for agent, samples in peer_samples.items():
            bucket = group.samples.setdefault(agent, [])
            for i, s in enumerate(samples):
                bucket.append((f"{episode_id}:{agent}:{i}", s))

    def _checked(self, agent: str, sample: HostSample) -> HostSample:
        limits = self.limits.get(agent)
        problem = limits.problem(sample, agent) if limits is not None else None
        if problem is None:
            return sample
        self.stats["items_refused"] += 1
        logger.warning(
            "a sample for %r cannot be trained by its model (%s); it is sent as an ABORTED filler",
            agent,
            problem,
        )
        metadata = dict(getattr(sample, "metadata", None) or {})
        metadata["mrlx"] = {**(metadata.get("mrlx") or {}), "refused": problem}
        return filler_sample(
            agent,
            group_index=sample.group_index,
            index=sample.index,
            rollout_id=getattr(sample, "rollout_id", None),
            reason=problem,
            metadata=metadata,
            pad_id=self.pad_ids.get(agent, 0),
        )

    def _unencodable(self, agent: str, sample: HostSample, problem: str) -> HostSample:
        """An ABORTED filler for a sample the coordinator's frames cannot carry: it keeps the
        sample's place in its group and nothing of its values (one of them is what failed)."""
        self.stats["items_refused"] += 1
        logger.warning(
            "a sample for %r cannot be encoded for the coordinator (%s); it is sent as an ABORTED filler",
            agent,
            problem,
        )
        metadata = getattr(sample, "metadata", None)
        mrlx = metadata.get("mrlx") if isinstance(metadata, dict) else None
        episode = mrlx.get("episode_id") if isinstance(mrlx, dict) else None
        meta = {"refused": problem, **({"episode_id": episode} if isinstance(episode, str) else {})}
        return filler_sample(
            agent,
            group_index=_plain(getattr(sample, "group_index", None)),
            index=_plain(getattr(sample, "index", None)),
            rollout_id=_plain(getattr(sample, "rollout_id", None)),
            reason=problem,
            metadata={"mrlx": meta},
            pad_id=self.pad_ids.get(agent, 0),
        )

    async def _send(
        self,
        client: CoordinatorClient,
        group_index: int | None,
        group: _Group,
        step: int,
        slot: str | None = None,
    ) -> list[str]:
        producer = self.settings.self_agent
        failures = []
        for agent, keyed in group.samples.items():
            if slot is not None:  # keyed by the step's place, whichever episodes fill it
                keyed = [(f"{slot}:{agent}:{n}", s) for n, (_, s) in enumerate(keyed)]
            keyed = [(k, self._checked(agent, s)) for k, s in keyed]
            if all(getattr(s, "remove_sample", False) for _, s in keyed):
                # Sent all the same (zero loss masks train nothing): the peer leases one step's
                # groups per step, and a missing group would leave its step short.
                self.stats["groups_all_aborted"] += 1
            name = slot if slot is not None else f"{producer}:{group_index}"

            def item(key: str, sample: HostSample, name: str = name, keyed: list = keyed) -> QueueItem:
                return item_from_sample(
                    sample, key=key, group=name, group_size=len(keyed), producer=producer, step=step
                )

            items = []
            for k, s in keyed:
                try:
                    items.append(item(k, s))
                except (ValueError, TypeError) as exc:
                    items.append(item(k, self._unencodable(agent, s, f"item {k!r}: {exc}")))
            try:
                try:
                    result = await client.commit(agent, items)
                except ValueError:  # WireError: the frame encoder refused a value
                    # Find the items it refuses (one encode each, off the event loop) and send
                    # fillers in their place: one bad sample must not fail the step. Items of the
                    # group that were stored before the refusal count as duplicates.
                    problems = await asyncio.to_thread(_encoding_problems, items)
                    if not problems:
                        raise
                    for i, problem in problems.items():
                        items[i] = item(keyed[i][0], self._unencodable(agent, keyed[i][1], problem))
                    result = await client.commit(agent, items)
            except (CoordinatorError, ValueError) as exc:
                failures.append(f"group {name} for {agent!r}: {exc}")
                continue
            self.stats["groups_sent"] += 1
            self.stats["samples_sent"] += result.accepted
            self.stats["duplicates"] += result.duplicates
            self.stats["stale"] += result.stale
        return failures

    def discard(self, group_index: int | None) -> None:
        """Drop a prompt group's samples: the host will not train it (a fully asynchronous rollout
        gives it back to be generated again, which adds its samples anew)."""
        if self.groups.pop(group_index, None) is not None:
            self.stats["groups_not_kept"] += 1

    async def commit_groups(
        self,
        client: CoordinatorClient,
        step: int,
        indices: set[int | None],
        slots: Mapping[int | None, str] | None = None,
    ) -> dict[str, float]:
        """Commit the groups `indices` under `step` through `client` (the others stay: under a fully
        asynchronous rollout they are still in flight, or queued for a later step); raise if a
        commit failed. Returns the counters since the last `drain`/`take_stats`.

        A group is named (and its items keyed) after its prompt group, unless `slots` names its
        place in the step instead: then a process resumed after a crash that commits the same
        step again, with other episodes in a place, repeats its predecessor's keys (duplicates,
        no-ops) rather than adding a group to a step its peers may already have trained.

        Commits retry through coordinator restarts and backpressure until their deadline; a
        group that still cannot be committed fails the rollout loudly rather than vanishing.
        """
        chosen = {k: self.groups.pop(k) for k in indices if k in self.groups}
        results = await asyncio.gather(
            *(self._send(client, k, g, step, (slots or {}).get(k)) for k, g in chosen.items())
        )
        failures = [f for r in results for f in r]
        if failures:
            raise CoordinatorError(
                f"could not hand {len(failures)} group(s) to the coordinator: " + "; ".join(failures[:3])
            )
        return {f"coordinator/{k}": float(v) for k, v in self.stats.items()}

    def take_stats(self) -> dict[str, float]:
        """The counters since the last call, as step metrics (then zeroed)."""
        stats = {f"coordinator/{k}": float(v) for k, v in self.stats.items()}
        self.stats = self._zero()
        return stats

    async def drain(
        self, client: CoordinatorClient, step: int, kept: set[int | None] | None
    ) -> dict[str, float]:
        """A synchronous step's end: commit the groups in `kept` (all when None) and drop the others
        (groups the host over-sampled and then filtered out or aborted)."""
        kept = set(self.groups) if kept is None else kept
        for k in set(self.groups) - kept:
            self.discard(k)
        try:
            await self.commit_groups(client, step, kept)
        finally:
            stats = self.take_stats()
        return stats


def _encoding_problems(items: Sequence[QueueItem]) -> dict[int, str]:
    """The frame encoder's refusal of each item it refuses, by position (blocking)."""
    problems = {}
    for i, item in enumerate(items):
        try:
            items_batch([item])
        except WireError as exc:
            problems[i] = str(exc)
    return problems


def _plain(value: object) -> int | str | None:
    """`value` where any frame carries it (an int or a string), else None."""
    return cast("int | str", value) if type(value) in (int, str) else None


async def initiator_barrier(
    client: CoordinatorClient,
    outbox: PeerOutbox,
    args: argparse.Namespace,
    rollout_id: int,
    samples_per_episode: Mapping[str, int] | None,
) -> dict[str, float]:
    """Report this job's version; wait until every trainable peer (`outbox.peer_agents`) is within
    the staleness bound. The first call also checks that each peer's queue holds one step of this
    job (`args`' batch flags times the system's samples per episode)."""
    c = outbox.settings.coordinator
    if not outbox.depth_checked:
        for agent in outbox.peer_agents:
            need, how = items_per_step(args, samples_per_episode, agent)
            await check_queue_depth(client, agent, need, f"one step of this job: {how}", outbox.source)
        outbox.depth_checked = True
    await client.heartbeat()
    await client.report_version(rollout_id)
    metrics: dict[str, float] = {}
    for agent in outbox.peer_agents:
        need = rollout_id - c.max_staleness
        started = time.monotonic()
        version = (
            await client.wait_version(agent, need, deadline_s=c.wait_deadline_s)
            if need > 0
            else (await client.get_version(agent) or 0)
        )
        metrics[f"coordinator/wait_seconds/{agent}"] = time.monotonic() - started
        outbox.peer_versions[agent] = int(version)
        metrics[f"staleness/{agent}"] = float(rollout_id - version)
    return metrics
