"""The responder's side of a multi-model run: the job of a peer agent, which trains on leased groups.

The job of a peer agent (a responder) never runs episodes. At the top of its step k,
`Responder.take` acknowledges, through a step watermark, every step its host has saved (so a
resumed job never trains them again), reports this job's version, takes over the leases of a
dead predecessor process (its first call only), and leases the groups of the initiator's step k,
and only those (B's rollout ids and A's are one numbering): whatever restarts happen, B's step k
trains A's step k. Leases are renewed while the step trains. A group the coordinator set aside
(dead-lettered), or that this job's model cannot take, becomes a group of ABORTED fillers of the
same size, so the step keeps the sample count the host's data-parallel split needs.

Exactly once: an item is trained at B's step of its producer step; it is acknowledged once that
step is saved (the embedded trainer: right after the save, `Responder.finish`; a slime job: at the
first rollout after a save that slime has made durable, see `save_rules`). A job resumed from the
checkpoint of step s trains steps after s again, with the same groups: their first training was
lost with the process, so each group is trained once in the model that survives.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from mrlx_plugin.core.host import HostSample
from mrlx_plugin.link.client import CoordinatorClient, CoordinatorError
from mrlx_plugin.link.codec import filler_sample, sample_from_item
from mrlx_plugin.link.job import check_queue_depth, items_per_step, make_client
from mrlx_plugin.link.limits import ModelLimits, read_model_limits
from mrlx_plugin.link.save_rules import save_window
from mrlx_plugin.link.wire import DeadLetter, QueueItem

if TYPE_CHECKING:
    from mrlx_plugin.core.config import Settings

logger = logging.getLogger(__name__)


@dataclass
class ResponderState:
    """What one responder process has done so far (kept across its steps)."""

    leases: list[str] = field(default_factory=list)
    renewer: asyncio.Task | None = None
    took_over: bool = False  # this process has taken its dead predecessor's leases over
    acked_through: int | None = None  # the step watermark this process has set
    depth_checked: bool = False


@dataclass
class _Taken:
    """What leasing one step has taken: the groups to train, those set aside (group name -> what the
    coordinator reported, or why this job refused it), how many this job refused, the leases."""

    groups: list[list[QueueItem]] = field(default_factory=list)
    dead: dict[str, DeadLetter] = field(default_factory=dict)
    rejected: int = 0
    leases: list[str] = field(default_factory=list)


@dataclass
class Responder:
    """A responder job's link to the coordinator: its client, its settings, what its model takes,
    the size of its steps, and its state. Built once per process (`for_job`)."""

    client: CoordinatorClient
    settings: Settings  # this job's: the agent it trains (`self`), the coordinator's settings
    source: str  # where the settings came from, for messages
    groups_per_step: int  # the producer's prompt groups per step (--rollout-batch-size)
    per_episode: int  # samples one producer episode makes for this agent (fillers per episode)
    queue_need: int  # items this agent's queue must hold: the steps it may hold unacknowledged
    queue_need_how: str  # how `queue_need` was counted, for messages
    limits: ModelLimits | None = None  # what this job's model takes (None: not checked)
    state: ResponderState = field(default_factory=ResponderState)

    @classmethod
    def for_job(
        cls,
        settings: Settings,
        source: str,
        args: argparse.Namespace,
        samples_per_episode: Mapping[str, int] | None,
    ) -> Responder:
        """The responder of a job with these settings and host flags (`args`: the batch flags, the
        save schedule, the model's limits); `samples_per_episode` is the system's, per agent.
        Blocking (reads the model's config.json): call it outside the event loop."""
        client = make_client(settings, source)  # refuses settings without a coordinator or `self`
        agent = client.agent
        need, how = items_per_step(args, samples_per_episode, agent)
        window, why = save_window(args)
        return cls(
            client=client,
            settings=settings,
            source=source,
            groups_per_step=int(args.rollout_batch_size),
            per_episode=(samples_per_episode or {}).get(agent) or 1,
            queue_need=need * window,
            queue_need_how=f"one step ({how})"
            if window == 1
            else f"{window} steps ({why}) of {need} items ({how})",
            limits=read_model_limits(args, getattr(args, "hf_checkpoint", None)),
        )

    @property
    def agent(self) -> str:
        """The agent this job trains."""
        return self.client.agent

    async def take(
        self, rollout_id: int, ack_through: int | None = None
    ) -> tuple[list[list[HostSample]], dict[str, float]]:
        """Acknowledge through `ack_through`, report this job's version, and take the groups of the
        producer's step `rollout_id`: `groups_per_step` of them, ABORTED fillers standing in for
        groups set aside (by the coordinator, or here because this job's model cannot take them).
        Returns the groups of samples and the step's metrics."""
        self._stop_renewing()
        metrics = await self._start_step(rollout_id, ack_through)
        started = time.monotonic()
        taken = await self._lease_step(rollout_id)
        dead_list = list(taken.dead.values())[: max(0, self.groups_per_step - len(taken.groups))]
        samples = [[sample_from_item(item) for item in g] for g in taken.groups]
        next_id = 1
        for ordinal, info in enumerate(dead_list):
            fillers = _filler_group(self.agent, info, ordinal, next_id, self.per_episode)
            next_id += -(-len(fillers) // self.per_episode)
            samples.append(fillers)
        # This step's leases become the state's (renewed while it trains) only now that its groups
        # are handed to the host.
        lease_s = self.settings.coordinator.lease_s
        self.state.leases = taken.leases
        self.state.renewer = asyncio.ensure_future(_renew(self.client, list(taken.leases), lease_s))
        metrics.update(
            {
                "coordinator/wait_seconds": time.monotonic() - started,
                "coordinator/groups": float(len(taken.groups)),
                "coordinator/dead_lettered_groups": float(len(dead_list)),
                "coordinator/dead_lettered_items": float(sum(int(d["size"]) for d in dead_list)),
                "coordinator/rejected_groups": float(taken.rejected),
            }
        )
        read = [_as_int(v) for g in samples for s in g for v in (s.weight_versions or [])]
        versions = [v for v in read if v is not None]
        if versions:
            metrics[f"staleness/{self.agent}"] = float(rollout_id - min(versions))
        return samples, metrics

    async def _start_step(self, rollout_id: int, ack_through: int | None) -> dict[str, float]:
        """Before a step's groups are leased: the queue's room checked (first step), the saved steps
        acknowledged, this job's heartbeat and version, and (a fresh process) a dead predecessor's
        leases taken over. Returns the step's first metrics."""
        client, state, agent = self.client, self.state, self.agent
        metrics: dict[str, float] = {}
        if not state.depth_checked:
            await check_queue_depth(client, agent, self.queue_need, self.queue_need_how, self.source)
            state.depth_checked = True
        if ack_through is not None:
            acked = await self._ack_through(ack_through)
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
        return metrics

    async def _lease_step(self, rollout_id: int) -> _Taken:
        """Lease the groups of the producer's step `rollout_id` until `groups_per_step` of them are
        taken or set aside, the producer ends the stream, or `wait_deadline_s` passes (an error)."""
        c = self.settings.coordinator
        groups_needed = self.groups_per_step
        deadline = time.monotonic() + c.wait_deadline_s
        taken = _Taken()
        why = "the producer sent no more"
        first = True
        while len(taken.groups) + len(taken.dead) < groups_needed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorError(
                    f"step {rollout_id}: got {len(taken.groups) + len(taken.dead)} of {groups_needed} groups "
                    f"in {c.wait_deadline_s:.0f}s (those of the producer's step {rollout_id}); {why}"
                )
            # The first call of a step asks without waiting: it learns every group of the step set
            # aside so far (also those set aside while an earlier process of this job held them).
            lease = await self.client.lease(
                groups_needed - len(taken.groups) - len(taken.dead),
                lease_s=c.lease_s,
                wait_s=0.0 if first else min(30.0, remaining),
                step=rollout_id,
            )
            first = False
            why = lease.message or why
            for info in lease.dead:
                taken.dead.setdefault(info["group"], info)
            if lease.lease_id and lease.groups:
                taken.leases.append(lease.lease_id)
                for group in lease.groups:
                    reason = self._refusal(group)
                    if reason is None:
                        taken.groups.append(group)
                    else:
                        await self._set_aside(group, reason, rollout_id, taken)
            if lease.end:
                break
        if not taken.groups and not taken.dead:
            raise CoordinatorError(
                f"step {rollout_id}: the producer ended the stream and no group is left to train on"
            )
        return taken

    async def _set_aside(self, group: list[QueueItem], reason: str, rollout_id: int, taken: _Taken) -> None:
        """This job's model cannot take `group`: set it aside now rather than fail on it at every
        delivery (its other items are dropped with it); it counts as set aside in `taken`."""
        name = group[0].group
        logger.warning("group %r of step %d set aside: %s", name, rollout_id, reason)
        try:
            await self.client.reject(name, reason)
        except CoordinatorError as exc:
            logger.warning(
                "could not report group %r as set aside (%s); it is skipped here all the same",
                name,
                exc,
            )
        taken.rejected += 1
        taken.dead.setdefault(name, {"group": name, "size": len(group), "step": rollout_id, "reason": reason})

    async def finish(self, step: int | None = None) -> None:
        """The host saved its step `step` (default: the step of the groups leased last): acknowledge
        every group through it. Never raises (a failure is retried at the next step)."""
        self._stop_renewing()
        if step is not None:
            await self._ack_through(step)

    async def aclose(self) -> None:
        """Stop renewing leases and close this event loop's connection (CLI and tests)."""
        self._stop_renewing()  # it would keep renewing leases through a closed client
        await self.client.close()

    def _stop_renewing(self) -> None:
        if self.state.renewer is not None:
            self.state.renewer.cancel()
            self.state.renewer = None

    def _refusal(self, group: list[QueueItem]) -> str | None:
        """Why this job's model cannot take `group` (its first item it cannot take), or None."""
        if self.limits is None:
            return None
        for item in group:
            problem = self.limits.problem(item, self.agent)
            if problem:
                return f"item {item.key}: {problem}"
        return None

    async def _ack_through(self, step: int) -> bool:
        """Acknowledge every group of the producer's steps up to `step` (they are trained and saved).

        Never raises: a failed acknowledgement (the coordinator unreachable past its outage
        deadline, its disk full) is logged and tried again at the next step, which acknowledges
        through at least the same step (a watermark: repeating it is harmless)."""
        state = self.state
        if step < 0 or (state.acked_through is not None and step <= state.acked_through):
            return True
        try:
            await self.client.ack_through(step)
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
    agent: str, dead: DeadLetter, ordinal: int, first_rollout_id: int, per_episode: int
) -> list[HostSample]:
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


async def _renew(client: CoordinatorClient, leases: list[str], lease_s: float) -> None:
    """Keep this step's leases while it trains (a dead responder stops renewing; its groups return)."""
    while True:
        await asyncio.sleep(max(1.0, lease_s / 3))
        for lease_id in leases:
            try:
                await client.extend(lease_id, lease_s)
            except CoordinatorError as exc:
                logger.warning("could not renew lease %s: %s", lease_id, exc)


def _as_int(value: object) -> int | None:
    try:
        return int(cast("str | int", value))
    except (TypeError, ValueError):
        return None
