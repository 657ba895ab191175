"""Keeping the jobs of a multi-model run in step, through the coordinator.

The job that runs the episodes (the initiator) trains its own agent on the samples the host gets
back, and hands every other trainable agent's samples to the coordinator:
- `PeerOutbox` holds those samples until the host's rollout returns, then commits, for each
  prompt group the host kept for this step, the group's samples for each agent in one request.
  A group reaches the peer whole (an ABORTED sample, with zero loss mask, stands in for an
  episode that did not finish, and for a sample the peer's model could not take: token ids
  outside its vocabulary, longer than its context), so the peer's GRPO groups are the
  initiator's prompt groups and each peer step trains on one initiator step. Evaluation sends
  nothing.
- `initiator_barrier` runs at the top of each of the initiator's rollouts (right after its
  trainer pushed new weights): it reports this job's version and waits until every other
  trainable agent is within `coordinator.max_staleness` versions.

The job of a peer agent (a responder) never runs episodes. At the top of its step k,
`responder_take` acknowledges, through a step watermark, every step its host has saved (so a
resumed job never trains them again), reports this job's version, takes over the leases of a
dead predecessor process (its first call only), and leases the groups of the initiator's step k,
and only those (B's rollout ids and A's are one numbering): whatever restarts happen, B's step k
trains A's step k. Leases are renewed while the step trains. A group the coordinator set aside
(dead-lettered), or that this job's model cannot take, becomes a group of ABORTED fillers of the
same size, so the step keeps the sample count the host's data-parallel split needs.

Exactly once: an item is trained at B's step of its producer step; it is acknowledged once that
step is saved (the embedded trainer: right after the save; a slime job: at the first rollout after
a save that slime has made durable). A job resumed from the checkpoint of step s trains steps
after s again, with the same groups: their first training was lost with the process, so each
group is trained once in the model that survives.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mrlx_plugin.core.config import ConfigError
from mrlx_plugin.core.host import Sample, Status
from mrlx_plugin.link.client import CoordinatorClient, CoordinatorError
from mrlx_plugin.link.wire import (
    SAMPLE_FIELDS,
    QueueItem,
    WireError,
    as_list,
    items_batch,
    token_from_env_or_file,
)

if TYPE_CHECKING:
    from mrlx_plugin.core.config import CoordinatorSettings, Settings
    from mrlx_plugin.core.tokenizer import AgentTokenizer

logger = logging.getLogger(__name__)


def make_client(settings: Settings, source: str) -> CoordinatorClient:
    """This job's coordinator client, from its settings (`source`: where they came from, for messages)."""
    c = settings.coordinator
    if not c.url:
        raise ConfigError(
            f"{source}: mrlx.coordinator.url is not set; a multi-model job needs the coordinator"
        )
    if settings.self_agent is None:
        raise ConfigError(f"{source}: mrlx.self is not set; name the agent this job trains")
    try:
        token = token_from_env_or_file(c.token_env, c.token_file)
    except ValueError as exc:
        raise ConfigError(f"{source}: mrlx.coordinator.token_file: {exc}") from None
    outage = max(1.0, float(getattr(c, "outage_deadline_s", 600.0)))
    return CoordinatorClient(
        c.url,
        run_id=settings.run_id,
        agent=settings.self_agent,
        token=token,
        request_timeout_s=c.request_timeout_s,
        outage_deadline_s=outage,
        commit_deadline_s=max(c.wait_deadline_s, outage),
    )


# ----------------------------------------------------------------------------------------------
# What a consumer's model can take
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelLimits:
    """The token ids and the sequence length an agent's trainer can take (None: not known)."""

    vocab_size: int | None
    max_length: int | None
    source: str  # where they were read, for messages

    def problem(self, item_or_sample: Any, agent: str) -> str | None:
        """Why this item (or sample) cannot be trained by `agent`'s model, or None."""
        tokens = item_or_sample.tokens
        if tokens is None or not len(tokens):
            return None
        if self.vocab_size is not None:
            low, high = min(tokens), max(tokens)
            if high >= self.vocab_size or low < 0:
                bad = high if high >= self.vocab_size else low
                return (
                    f"token id {bad} is outside the vocabulary of {agent!r}'s model ({self.vocab_size} ids, "
                    f"{self.source})"
                )
        if self.max_length is not None and len(tokens) > self.max_length:
            return (
                f"{len(tokens)} tokens are more than {agent!r}'s model takes ({self.max_length}, "
                f"{self.source})"
            )
        return None


def read_model_limits(
    args: Any | None, model_dir: str | None, fallback_vocab: int | None = None
) -> ModelLimits:
    """An agent's limits: from the host's own flags where it has them (`--vocab-size`/the padded
    vocabulary, `--max-position-embeddings`), else from the model's `config.json` in `model_dir`
    (vocab_size; max_position_embeddings, times a rope_scaling factor), else the tokenizer's
    vocabulary (`fallback_vocab`). Blocking (reads a file): call it outside the event loop."""
    vocab = max_len = None
    where = []
    if args is not None:
        vocab = getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None)
        max_len = getattr(args, "max_position_embeddings", None)
        if vocab or max_len:
            where.append("the host's flags")
    config: dict[str, Any] = {}
    if model_dir:
        try:
            with open(os.path.join(str(model_dir), "config.json"), encoding="utf-8") as handle:
                config = json.load(handle)
        except (OSError, ValueError):
            config = {}
        config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    if vocab is None and isinstance(config.get("vocab_size"), int):
        vocab = config["vocab_size"]
        where.append(f"{model_dir}/config.json")
    if max_len is None and isinstance(config.get("max_position_embeddings"), int):
        max_len = config["max_position_embeddings"]
        scaling = config.get("rope_scaling") or {}
        factor = scaling.get("factor") if isinstance(scaling, dict) else None
        if isinstance(factor, (int, float)) and factor > 1:
            max_len = int(max_len * factor)
        if f"{model_dir}/config.json" not in where:
            where.append(f"{model_dir}/config.json")
    if vocab is None and fallback_vocab:
        vocab = fallback_vocab
        where.append("its tokenizer")
    return ModelLimits(
        int(vocab) if vocab else None, int(max_len) if max_len else None, " and ".join(where) or "unknown"
    )


def filler_sample(
    agent: str,
    *,
    group_index: Any,
    index: Any,
    rollout_id: Any,
    reason: str,
    metadata: dict[str, Any] | None = None,
    pad_id: int = 0,
) -> Any:
    """An ABORTED sample that trains nothing and that any model can take: reward 0.0, zero loss
    mask, `remove_sample`, two token ids (`pad_id`), no weight version. It stands in for a sample
    that cannot be trained, so that a step keeps its sample count."""
    from mrlx_plugin.core.host import Sample

    sample = Sample()
    for name, value in (
        ("group_index", group_index),
        ("index", index),
        ("rollout_id", rollout_id),
        ("prompt", ""),
        ("response", ""),
        ("label", None),
    ):
        setattr(sample, name, value)
    sample.tokens = [pad_id, pad_id]
    sample.response_length = 1
    sample.loss_mask = [0]
    sample.rollout_log_probs = [0.0]
    sample.weight_versions = []
    sample.reward = 0.0
    sample.status = Status.ABORTED
    sample.remove_sample = True
    meta = dict((metadata or {}).get("mrlx") or {})
    meta.update(agent=agent, aborted=True)
    meta.setdefault("filler", reason)
    sample.metadata = {**(metadata or {}), "mrlx": meta}
    return sample


# ----------------------------------------------------------------------------------------------
# The initiator
# ----------------------------------------------------------------------------------------------


@dataclass
class _Group:
    episodes: int = 0
    samples: dict[str, list[tuple[str, Any]]] = field(default_factory=dict)  # agent -> [(key, sample)]


class PeerOutbox:
    """Other agents' samples of this job's episodes, committed per prompt group at rollout end.

    The generate function adds each episode's samples for other agents as soon as its rewards are
    known, into the step its rollout function opened (`open_step`: samples without an open step
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
        self.groups: dict[Any, _Group] = {}
        self.stats = self._zero()
        self.limits: dict[str, ModelLimits] = {}  # peer agent -> what its model takes
        self.pad_ids: dict[str, int] = {}
        self.depth_checked = False

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
        """Refuse to run training episodes whose peer samples would have no step to go to."""
        if self.step is None:
            raise ConfigError(
                f"{self.source}: this job's episodes have samples for {', '.join(self.peer_agents)}, "
                "trained by other jobs, but no step is open: episodes ran outside "
                "mrlx_plugin.rollout.initiator_rollout; set --rollout-function-path "
                "mrlx_plugin.rollout.initiator_rollout"
            )

    def load_limits(self, args: Any, tokenizers: Mapping[str, AgentTokenizer]) -> None:
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

    def add(self, group_index: Any, episode_id: str, peer_samples: dict[str, list[Any]]) -> None:
        """Record one ended episode's samples for other agents (rewards are final by now)."""
        self.require_step()
        group = self.groups.setdefault(group_index, _Group())
        group.episodes += 1
        for agent, samples in peer_samples.items():
            bucket = group.samples.setdefault(agent, [])
            for i, s in enumerate(samples):
                bucket.append((f"{episode_id}:{agent}:{i}", s))

    def _checked(self, agent: str, sample: Any) -> Any:
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

    def _unencodable(self, agent: str, sample: Any, problem: str) -> Any:
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

    async def _send(self, client: CoordinatorClient, group_index: Any, group: _Group, step: int) -> list[str]:
        producer = self.settings.self_agent
        failures = []
        for agent, keyed in group.samples.items():
            keyed = [(k, self._checked(agent, s)) for k, s in keyed]
            if all(getattr(s, "remove_sample", False) for _, s in keyed):
                # Sent all the same (zero loss masks train nothing): the peer leases one step's
                # groups per step, and a missing group would leave its step short.
                self.stats["groups_all_aborted"] += 1
            name = f"{producer}:{group_index}"

            def item(key: str, sample: Any, name: str = name, keyed: list = keyed) -> QueueItem:
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

    async def drain(self, client: CoordinatorClient, step: int, kept: set[Any] | None) -> dict[str, float]:
        """Commit the groups in `kept` (all when None) through `client`, drop the others; raise if
        a commit failed.

        Commits retry through coordinator restarts and backpressure until their deadline; a
        group that still cannot be committed fails the rollout loudly rather than vanishing.
        """
        groups, self.groups = self.groups, {}
        chosen = {k: g for k, g in groups.items() if kept is None or k in kept}
        self.stats["groups_not_kept"] += len(groups) - len(chosen)
        results = await asyncio.gather(*(self._send(client, k, g, step) for k, g in chosen.items()))
        failures = [f for r in results for f in r]
        step_stats = {f"coordinator/{k}": float(v) for k, v in self.stats.items()}
        self.stats = self._zero()
        if failures:
            raise CoordinatorError(
                f"could not hand {len(failures)} group(s) to the coordinator: " + "; ".join(failures[:3])
            )
        return step_stats


def _encoding_problems(items: Sequence[QueueItem]) -> dict[int, str]:
    """The frame encoder's refusal of each item it refuses, by position (blocking)."""
    problems = {}
    for i, item in enumerate(items):
        try:
            items_batch([item])
        except WireError as exc:
            problems[i] = str(exc)
    return problems


def _plain(value: Any) -> Any:
    """`value` where any frame carries it (an int or a string), else None."""
    return value if type(value) in (int, str) else None


def items_per_step(args: Any, fan_out: Mapping[str, int] | None, agent: str) -> tuple[int, str]:
    """How many items one step hands `agent`'s queue: (count, how it was counted). `fan_out`: the
    system's samples per episode and agent (None: one)."""
    groups = int(getattr(args, "rollout_batch_size", 1) or 1)
    per_prompt = int(getattr(args, "n_samples_per_prompt", 1) or 1)
    fan = (fan_out or {}).get(agent) or 1
    how = f"{groups} groups (--rollout-batch-size) x {per_prompt} samples per prompt (--n-samples-per-prompt)"
    if fan != 1:
        how += f" x {fan} samples per episode for {agent!r}"
    return groups * per_prompt * fan, how


async def check_queue_depth(client: CoordinatorClient, agent: str, need: int, how: str, source: str) -> None:
    """Refuse a coordinator whose queue for `agent` cannot hold `need` items: the producer would
    block on a full queue that its consumer cannot drain before it has its whole step."""
    info = await client.queue_info(agent)
    depth = info.get("max_depth")
    if isinstance(depth, int) and depth < need:
        raise ConfigError(
            f"{source}: the coordinator's queue of {agent!r} holds at most {depth} items (--max-depth "
            f"{depth}), "
            f"but {how} makes {need}: the producer would wait for room that the consumer frees only once it "
            "has trained its step, and both jobs would stop. Restart the coordinator with --max-depth "
            f"{need} "
            "or more"
        )


async def initiator_barrier(
    client: CoordinatorClient,
    outbox: PeerOutbox,
    args: Any,
    rollout_id: int,
    fan_out: Mapping[str, int] | None,
) -> dict[str, float]:
    """Report this job's version; wait until every trainable peer (`outbox.peer_agents`) is within
    the staleness bound. The first call also checks that each peer's queue holds one step of this
    job (`args`' batch flags times the system's `fan_out`)."""
    c = outbox.settings.coordinator
    if not outbox.depth_checked:
        for agent in outbox.peer_agents:
            need, how = items_per_step(args, fan_out, agent)
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
        metrics[f"staleness/{agent}"] = float(rollout_id - version)
    return metrics


# ----------------------------------------------------------------------------------------------
# The responder
# ----------------------------------------------------------------------------------------------


@dataclass
class ResponderState:
    leases: list[str] = field(default_factory=list)
    renewer: asyncio.Task | None = None
    took_over: bool = False  # this process has taken its dead predecessor's leases over
    acked_through: int | None = None  # the step watermark this process has set
    limits: ModelLimits | None = None  # what this job's model takes (read by the rollout function)
    depth_checked: bool = False


async def _ack_through(client: CoordinatorClient, state: ResponderState, step: int) -> bool:
    """Acknowledge every group of the producer's steps up to `step` (they are trained and saved).

    Never raises: a failed acknowledgement (the coordinator unreachable past its outage deadline,
    its disk full) is logged and tried again at the next step, which acknowledges through at least
    the same step (a watermark: repeating it is harmless)."""
    if step < 0 or (state.acked_through is not None and step <= state.acked_through):
        return True
    try:
        await client.ack_through(step)
    except CoordinatorError as exc:
        logger.warning(
            "could not acknowledge the groups of steps up to %d (%s); trying again at the next step",
            step,
            exc,
        )
        return False
    state.acked_through = step
    return True


def _filler_group(
    agent: str, dead: dict[str, Any], ordinal: int, first_rollout_id: int, per_episode: int
) -> list[Any]:
    """ABORTED fillers for a group set aside: as many as it had items, with rollout ids of their
    own (one per episode of the producer, negative: never a real episode's), training nothing."""
    reason = str(dead.get("reason") or "set aside")
    out = []
    for i in range(int(dead["size"])):
        episode = i // max(1, per_episode)
        metadata = {
            "mrlx": {
                "episode_id": f"dead-letter:{dead['group']}:{episode}",
                "turns": 0,
                "dead_letter": {"group": dead["group"], "step": dead.get("step"), "reason": reason},
            }
        }
        out.append(
            filler_sample(
                agent,
                group_index=-(1 + ordinal),
                index=None,
                rollout_id=-(first_rollout_id + episode),
                reason=reason,
                metadata=metadata,
            )
        )
    return out


async def responder_take(
    client: CoordinatorClient,
    state: ResponderState,
    args: Any,
    rollout_id: int,
    groups_needed: int,
    *,
    agent: str,
    coordinator: CoordinatorSettings,
    fan_out: Mapping[str, int] | None,
    source: str,
    ack_through: int | None = None,
) -> tuple[list[list[Any]], dict[str, float]]:
    """Acknowledge through `ack_through`, report this job's version, and take the groups of the
    producer's step `rollout_id` for this job's `agent`: `groups_needed` of them, ABORTED fillers
    standing in for groups set aside (by the coordinator, or here because this job's model cannot
    take them). `state` is this process's responder state; `fan_out` the system's samples per
    episode and agent (how many fillers stand in for one episode); `args` the host's flags (the
    queue depth one step and the save window need); `source` names the settings in messages."""
    c = coordinator
    if state.renewer is not None:
        state.renewer.cancel()
        state.renewer = None
    metrics: dict[str, float] = {}
    if not state.depth_checked:
        need, how = items_per_step(args, fan_out, agent)
        window, why = save_window(args)
        what = f"one step ({how})" if window == 1 else f"{window} steps ({why}) of {need} items ({how})"
        await check_queue_depth(client, agent, need * window, what, source)
        state.depth_checked = True
    if ack_through is not None:
        acked = await _ack_through(client, state, ack_through)
        metrics["coordinator/ack_failed"] = 0.0 if acked else 1.0
    if state.acked_through is not None:
        metrics["coordinator/acked_through"] = float(state.acked_through)
    await client.heartbeat()
    await client.report_version(rollout_id)
    if not state.took_over:
        # A fresh process: leases still held under this agent's name are a dead process's. Their
        # groups are leasable at once (each lease counted as a delivery) instead of after lease_s.
        released = await client.release()
        state.took_over = True
        metrics["coordinator/leases_taken_over"] = float(released)
        if released:
            logger.info("took over %d leased groups of a previous process of %r", released, agent)
    started = time.monotonic()
    deadline = started + c.wait_deadline_s
    groups: list[list[QueueItem]] = []
    dead: dict[str, dict[str, Any]] = {}  # group name -> what the coordinator reported
    rejected = 0
    # This step's leases become the state's (to be renewed while it trains) only when the groups
    # are handed to the host.
    leases: list[str] = []
    why = "the producer sent no more"
    first = True
    while len(groups) + len(dead) < groups_needed:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CoordinatorError(
                f"step {rollout_id}: got {len(groups) + len(dead)} of {groups_needed} groups in "
                f"{c.wait_deadline_s:.0f}s (those of the producer's step {rollout_id}); {why}"
            )
        # The first call of a step asks without waiting: it learns every group of the step set
        # aside so far (also those set aside while an earlier process of this job held them).
        lease = await client.lease(
            groups_needed - len(groups) - len(dead),
            lease_s=c.lease_s,
            wait_s=0.0 if first else min(30.0, remaining),
            step=rollout_id,
        )
        first = False
        why = lease.message or why
        for info in lease.dead:
            dead.setdefault(info["group"], info)
        if lease.lease_id and lease.groups:
            leases.append(lease.lease_id)
            for group in lease.groups:
                problem = None
                if state.limits is not None:
                    problem = next(
                        (p for p in (state.limits.problem(item, agent) for item in group) if p), None
                    )
                if problem is None:
                    groups.append(group)
                    continue
                # This job's model cannot take it: set it aside now rather than fail on it at every
                # delivery. The group's other items are dropped with it.
                name = group[0].group
                reason = f"item {next(i.key for i in group if state.limits.problem(i, agent))}: {problem}"
                logger.warning("group %r of step %d set aside: %s", name, rollout_id, reason)
                try:
                    await client.reject(name, reason)
                except CoordinatorError as exc:
                    logger.warning(
                        "could not report group %r as set aside (%s); it is skipped here all the same",
                        name,
                        exc,
                    )
                rejected += 1
                dead.setdefault(
                    name, {"group": name, "size": len(group), "step": rollout_id, "reason": reason}
                )
        if lease.end:
            break
    if not groups and not dead:
        raise CoordinatorError(
            f"step {rollout_id}: the producer ended the stream and no group is left to train on"
        )
    dead_list = list(dead.values())[: max(0, groups_needed - len(groups))]
    samples = [[sample_from_item(item) for item in g] for g in groups]
    per_episode = (fan_out or {}).get(agent) or 1
    next_id = 1
    for ordinal, info in enumerate(dead_list):
        fillers = _filler_group(agent, info, ordinal, next_id, per_episode)
        next_id += -(-len(fillers) // per_episode)
        samples.append(fillers)
    state.leases = leases
    state.renewer = asyncio.ensure_future(_renew(client, list(leases), c.lease_s))
    metrics.update(
        {
            "coordinator/wait_seconds": time.monotonic() - started,
            "coordinator/groups": float(len(groups)),
            "coordinator/dead_lettered_groups": float(len(dead_list)),
            "coordinator/dead_lettered_items": float(sum(int(d["size"]) for d in dead_list)),
            "coordinator/rejected_groups": float(rejected),
        }
    )
    versions = [_as_int(v) for g in samples for s in g for v in (s.weight_versions or [])]
    versions = [v for v in versions if v is not None]
    if versions:
        metrics[f"staleness/{agent}"] = float(rollout_id - min(versions))
    return samples, metrics


async def responder_finish(client: CoordinatorClient, state: ResponderState, step: int | None = None) -> None:
    """The host saved its step `step` (default: the step of the groups leased last): acknowledge
    every group through it. Never raises (a failure is retried at the next step)."""
    if state.renewer is not None:
        state.renewer.cancel()
        state.renewer = None
    if step is not None:
        await _ack_through(client, state, step)


def save_window(args: Any) -> tuple[int, str]:
    """How many of the producer's steps a responder may hold unacknowledged at once: the steps
    since the last durable save, plus the one it waits for. (1, ...) without saves to wait for."""
    interval = getattr(args, "save_interval", None)
    if not getattr(args, "save", None) or not interval:
        return 1, "no --save: every step is acknowledged when the next begins"
    interval = int(interval)
    if getattr(args, "async_save", False):
        return 2 * interval, f"--save-interval {interval} with --async-save"
    return interval, f"--save-interval {interval}"


def _saves_at(args: Any, rollout_id: int) -> bool:
    """slime's `should_run_periodic_action(rollout_id, args.save_interval, num_rollout_per_epoch,
    args.num_rollout)`: whether its loop saves after training `rollout_id`."""
    interval = getattr(args, "save_interval", None)
    if interval is None:
        return False
    num_rollout = getattr(args, "num_rollout", None)
    if num_rollout is not None and rollout_id == int(num_rollout) - 1:
        return True
    step = rollout_id + 1
    per_epoch = getattr(args, "num_rollout_per_epoch", None)
    return step % int(interval) == 0 or (per_epoch is not None and step % int(per_epoch) == 0)


def durable_step_before(args: Any, rollout_id: int) -> int:
    """The last step whose training a job resumed now would not repeat, seen from the top of its
    step `rollout_id` (-1: none). slime's loop per step is rollout -> train -> save (every
    `--save-interval` steps and the last) -> weight push, and a resumed job continues after the
    checkpoint it loads:
    - without `--save` (or `--save-interval`) nothing is ever resumed: every step before this one;
    - otherwise the last step saved before this one;
    - with `--async-save` that save may still be in flight: the save before it."""
    if not getattr(args, "save", None) or not getattr(args, "save_interval", None):
        return rollout_id - 1
    skip = 1 if getattr(args, "async_save", False) else 0
    for step in range(rollout_id - 1, -1, -1):
        if _saves_at(args, step):
            if not skip:
                return step
            skip -= 1
    return -1


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


def item_from_sample(
    sample: Any, *, key: str, group: str, group_size: int, producer: str, step: int
) -> QueueItem:
    """A `QueueItem` carrying `sample` (the host's Sample or ours) to the consumer's queue.

    The arrays are taken as they are (no copy); the scalar and JSON attributes named in
    `SAMPLE_FIELDS` go into `fields` (status as its string value).
    """
    fields: dict[str, Any] = {}
    for name in SAMPLE_FIELDS:
        value = getattr(sample, name, None)
        if value is None:
            continue
        if name == "status":
            value = getattr(value, "value", value)
        fields[name] = value
    return QueueItem(
        key=key,
        group=group,
        group_size=group_size,
        producer=producer,
        step=step,
        tokens=sample.tokens,
        response_length=sample.response_length,
        loss_mask=sample.loss_mask if sample.loss_mask is not None else (),
        rollout_log_probs=sample.rollout_log_probs if sample.rollout_log_probs is not None else (),
        fields=fields,
    )


def sample_from_item(item: QueueItem) -> Any:
    """The host's Sample (or our stand-in) for a decoded item, ready for the consumer's trainer.

    Fields the Sample class does not declare are set as attributes, so nothing the producer sent
    is dropped. Lists are handed over without a copy.
    """
    sample = Sample()
    for name, value in item.fields.items():
        if name == "status":
            value = Sample.Status(value)
        elif name == "metadata":
            value = dict(value)
        setattr(sample, name, value)
    sample.tokens = as_list(item.tokens)
    sample.response_length = item.response_length
    sample.loss_mask = as_list(item.loss_mask)
    sample.rollout_log_probs = as_list(item.rollout_log_probs)
    return sample
