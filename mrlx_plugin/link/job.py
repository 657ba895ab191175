"""What both jobs of a multi-model run set up the same way: the coordinator client and the queue's room.

`make_client` builds a job's coordinator client from its settings. At its first step each job
checks that the coordinator's queue between them holds what one step puts in it
(`items_per_step`, `check_queue_depth`): a queue that cannot would stop both jobs, the producer
waiting for room that the consumer frees only once it has its whole step.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING

from mrlx_plugin.core.config import ConfigError
from mrlx_plugin.link.auth import token_from_env_or_file
from mrlx_plugin.link.client import CoordinatorClient

if TYPE_CHECKING:
    from mrlx_plugin.core.config import Settings


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


def items_per_step(
    args: argparse.Namespace, samples_per_episode: Mapping[str, int] | None, agent: str
) -> tuple[int, str]:
    """How many items one step hands `agent`'s queue: (count, how it was counted).
    `samples_per_episode`: the system's samples per episode and agent (None: one)."""
    groups = int(getattr(args, "rollout_batch_size", 1) or 1)
    per_prompt = int(getattr(args, "n_samples_per_prompt", 1) or 1)
    fan = (samples_per_episode or {}).get(agent) or 1
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
            f"{depth}), but {how} makes {need}: the producer would wait for room that the consumer frees "
            "only once it has trained its step, and both jobs would stop. Restart the coordinator with "
            f"--max-depth {need} or more"
        )
