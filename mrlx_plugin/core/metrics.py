"""Rollout metrics for multi-agent episodes, through `--custom-rollout-log-function-path`.

Every sample the generate function returns carries `metadata["mrlx"]` (agent, episode id, turns,
token counts, aborted/retried turns, ...), so the metrics are computed from the samples alone:

| key | meaning |
|---|---|
| `reward/<agent>/mean` | mean raw (graded, unshaped) reward of the agent's samples |
| `reward/<agent>/shaped_mean` | mean reward the agent trains on (after team weighting/shaping) |
| `multi_agent/episodes` | episodes in the rollout |
| `multi_agent/avg_turns` | model turns per episode (with tree sampling: the candidates gone on from) |
| `multi_agent/engine_calls` | engine calls per episode: turns, tree-sampling candidates, rollout moves |
| `multi_agent/early_termination_rate` | episodes a stop rule ended before `max_turns` |
| `multi_agent/conversation_token_count` | tokens per episode, summed over every agent's view |
| `multi_agent/team_reward` | mean grade of the team's final answer |
| `multi_agent/invalid_selection_rate` | pipeline episodes whose selector named no valid rewrite |
| `multi_agent/aborted_episodes`, `multi_agent/aborted_turns` | engine faults and aborts |
| `multi_agent/malformed_answers` | episodes ended by an engine answer no one may train on |
| `multi_agent/over_context_samples` | ABORTED samples standing for what did not fit the context limit |
| `multi_agent/retried_turns` | turns that needed a retry (engine fault or peer abort) |
| `loss_mask/role_split/<agent>` | share of all trainable tokens that belong to the agent |
| `samples/<agent>` | samples of the agent in the rollout (ABORTED ones, fillers included, left out) |
| `game/episodes` | game episodes in the rollout (`system: game`) |
| `game/illegal_rate` | finished game episodes that an illegal move ended |
| `game/win_rate/<seat>` | finished game episodes the seat won (highest outcome, alone; one seat: above 0) |
| `game/win_rate/vs/<opponent>` | first agent seat's win rate per opponent met (an agent or `script:NAME`) |
| `game/draw_rate` | finished game episodes no seat won (only when there were some) |
| `multi_agent/opponent_down` | game episodes ended at once because the pool member they drew was down |
| `game/replays` | TextArena moves that replayed their game from the seed, its live env no longer kept |
| `debate/invalid_verdict_rate` | finished debate episodes whose judge named no winner (`system: debate`) |
| `debate/win_rate/<side>` | finished debate episodes the side (`A`: the first debater, `B`) won |
| `credit/branch_candidates` | engine calls per episode on tree-sampling candidates not gone on from |
| `credit/turn_samples` | samples that are one model turn (`rewards.credit: turn`), aborted ones left out |
| `agents/requests`, `agents/tool_calls` | agents as code: endpoint requests, parsed tool calls per episode |
| `agents/malformed_tool_call_rate` | tool calls a parser could not read (left as text), of all it found |
| `agents/forks`, `agents/refused_requests` | conversations from rewritten histories; 4xx, per episode |
| `agents/undelivered_requests` | requests undone unanswered (client left, episode ended), per episode |
"""

from __future__ import annotations

import argparse
import importlib
import logging
from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrlx_plugin.core.host import HostSample

logger = logging.getLogger(__name__)

# A sample's `metadata["mrlx"]` record (`episodes.samples.sample_meta` writes it) as read back
# here: free-form values of the kinds that writer (and each system, under "episode") gives them,
# summed and compared as such: `Any`.
Record = dict[str, Any]


def _meta(sample: object) -> Record:
    return (getattr(sample, "metadata", None) or {}).get("mrlx") or {}


def compute_metrics(samples: Iterable[HostSample]) -> dict[str, float]:
    """The table above, for a flat list of samples (samples without mrlx metadata are ignored)."""
    out: dict[str, float] = {}
    rewards: dict[str, list[float]] = defaultdict(list)
    shaped: dict[str, list[float]] = defaultdict(list)
    trained_tokens: dict[str, int] = defaultdict(int)
    episodes: dict[str, Record] = {}
    turn_samples = 0
    over_context = 0
    for s in samples:
        m = _meta(s)
        if not m:
            continue
        agent = m.get("agent") or "unknown"
        episodes.setdefault(m["episode_id"], m)
        over_context += bool(m.get("over_context"))
        if m.get("aborted") or getattr(s, "remove_sample", False):  # an aborted episode's, or a filler
            continue
        if m.get("turn") is not None:
            turn_samples += 1
        if m.get("raw_reward") is not None:
            rewards[agent].append(float(m["raw_reward"]))
        if isinstance(s.reward, (int, float)):
            shaped[agent].append(float(s.reward))
        trained_tokens[agent] += sum(s.loss_mask or [])
    for agent in sorted(set(rewards) | set(shaped)):
        if rewards[agent]:
            out[f"reward/{agent}/mean"] = sum(rewards[agent]) / len(rewards[agent])
        if shaped[agent]:
            out[f"reward/{agent}/shaped_mean"] = sum(shaped[agent]) / len(shaped[agent])
            out[f"samples/{agent}"] = float(len(shaped[agent]))
    total = sum(trained_tokens.values())
    for agent, n in sorted(trained_tokens.items()):
        out[f"loss_mask/role_split/{agent}"] = n / total if total else 0.0
    if episodes:
        eps = list(episodes.values())
        n = len(eps)
        out["multi_agent/episodes"] = float(n)
        out["multi_agent/avg_turns"] = sum(e.get("turns", 0) for e in eps) / n
        out["multi_agent/engine_calls"] = sum(e.get("engine_calls", 0) for e in eps) / n
        out["multi_agent/early_termination_rate"] = sum(bool(e.get("stopped_early")) for e in eps) / n
        out["multi_agent/conversation_token_count"] = sum(e.get("conversation_tokens", 0) for e in eps) / n
        out["multi_agent/aborted_episodes"] = float(sum(bool(e.get("aborted")) for e in eps))
        out["multi_agent/aborted_turns"] = float(sum(e.get("aborted_turns", 0) for e in eps))
        out["multi_agent/retried_turns"] = float(sum(e.get("retried_turns", 0) for e in eps))
        out["multi_agent/malformed_answers"] = float(
            sum(bool((e.get("episode") or {}).get("malformed_answer")) for e in eps)
        )
        out["multi_agent/over_context_samples"] = float(over_context)
        finished = [e for e in eps if not e.get("aborted")]
        if finished:
            out["multi_agent/team_reward"] = sum(float(e.get("team_reward") or 0.0) for e in finished) / len(
                finished
            )
        selecting = [e for e in finished if "selected" in e["episode"] or "invalid_selection" in e["episode"]]
        if selecting:
            invalid = sum(bool(e["episode"].get("invalid_selection")) for e in selecting)
            out["multi_agent/invalid_selection_rate"] = invalid / len(selecting)
        out.update(_game_metrics(eps))
        out.update(_debate_metrics(finished))
        out.update(_agent_code_metrics(eps))
        if any("branch_candidates" in (e.get("episode") or {}) for e in eps):  # tree sampling was on
            branched = sum(float((e.get("episode") or {}).get("branch_candidates", 0)) for e in eps)
            out["credit/branch_candidates"] = branched / n
    if turn_samples:
        out["credit/turn_samples"] = float(turn_samples)
    return out


def _agent_code_metrics(eps: list[Record]) -> dict[str, float]:
    """The `agents/` metrics of episodes of agent code (their facts: `mrlx_plugin.agents.chat`)."""
    stats = [s for e in eps for s in ((e.get("episode") or {}).get("agent_code") or {}).values()]
    if not stats:
        return {}
    n = sum(1 for e in eps if (e.get("episode") or {}).get("agent_code"))
    total = {k: sum(s.get(k, 0) for s in stats) for k in ("requests", "tool_calls", "malformed_tool_calls")}
    found = total["tool_calls"] + total["malformed_tool_calls"]
    out = {
        "agents/requests": total["requests"] / n,
        "agents/tool_calls": total["tool_calls"] / n,
        "agents/forks": sum(s.get("forks", 0) for s in stats) / n,
        "agents/refused_requests": sum(s.get("refused", 0) for s in stats) / n,
        "agents/undelivered_requests": sum(s.get("undelivered", 0) for s in stats) / n,
    }
    if found:
        out["agents/malformed_tool_call_rate"] = total["malformed_tool_calls"] / found
    return out


def _debate_metrics(finished: list[Record]) -> dict[str, float]:
    """The `debate/` metrics of the finished debate episodes (their facts: `systems.debate`)."""
    debates = [e["episode"] for e in finished if "invalid_verdict" in (e.get("episode") or {})]
    if not debates:
        return {}
    n = len(debates)
    out = {"debate/invalid_verdict_rate": sum(bool(d["invalid_verdict"]) for d in debates) / n}
    for side in ("A", "B"):
        out[f"debate/win_rate/{side}"] = sum(d.get("winner_side") == side for d in debates) / n
    return out


def _game_metrics(eps: list[Record]) -> dict[str, float]:
    """The `game/` metrics of the game episodes among `eps` (their facts: `systems.game`)."""
    games = [e for e in eps if "game" in (e.get("episode") or {})]
    finished = [e["episode"] for e in games if not e.get("aborted") and "outcome" in e["episode"]]
    out: dict[str, float] = {}
    if not games:
        return out
    out["game/episodes"] = float(len(games))
    # Ended at once because the opponent-pool member they drew was down (systems.game).
    out["multi_agent/opponent_down"] = float(sum(bool(e["episode"].get("opponent_down")) for e in games))
    replays = [e["episode"]["replays"] for e in games if "replays" in e["episode"]]
    if replays:  # TextArena games: moves that replayed their game from the seed (systems.library_games)
        out["game/replays"] = float(sum(replays))
    if not finished:
        return out
    n = len(finished)
    out["game/illegal_rate"] = sum("illegal_move" in g for g in finished) / n
    seats = dict.fromkeys(seat for g in finished for seat in g.get("seats") or [])
    for seat in seats:
        out[f"game/win_rate/{seat}"] = sum(g.get("winner") == seat for g in finished) / n
    draws = sum(g.get("winner") is None for g in finished if len(g.get("outcome") or []) > 1)
    if draws:
        out["game/draw_rate"] = draws / n
    met: dict[str, list[bool]] = defaultdict(list)
    for g in finished:
        if g.get("opponent") and g.get("first_seat"):
            met[g["opponent"]].append(g.get("winner") == g["first_seat"])
    for opponent, wins in sorted(met.items()):
        out[f"game/win_rate/vs/{opponent}"] = sum(wins) / len(wins)
    return out


def log_rollout(
    rollout_id: int,
    args: argparse.Namespace,
    samples: list[HostSample],
    rollout_extra_metrics: dict | None,
    rollout_time: float,
) -> bool:
    """`--custom-rollout-log-function-path`: add the multi-agent metrics to the host's log.

    The host logs `rollout_extra_metrics` with its own metrics right after this returns False,
    so the metrics are merged into that dict (same step, same backend: wandb, tensorboard).
    When the host passed no dict, they are logged here, on the host's rollout step. Returns
    False: the host's own rollout metrics are still logged.
    """
    metrics = compute_metrics(samples)
    if isinstance(rollout_extra_metrics, dict):
        rollout_extra_metrics.update(metrics)
    else:
        log_through_host(args, metrics, rollout_id, evaluation=False)
    return False


def log_eval_rollout(
    rollout_id: int, args: argparse.Namespace, data: dict, extra_metrics: dict | None
) -> bool:
    """`--custom-eval-rollout-log-function-path`: per-dataset multi-agent metrics under `eval/<name>/`.

    Both hosts log the eval output's `metrics` after this returns, and their own rollouts leave
    it None: then there is no dict to merge into, and the metrics are logged here, on the host's
    `eval/step`."""
    metrics: dict[str, float] = {}
    for name, entry in (data or {}).items():
        for key, value in compute_metrics(entry.get("samples") or []).items():
            metrics[f"eval/{name}/{key}"] = value
    if isinstance(extra_metrics, dict):
        extra_metrics.update(metrics)
    elif metrics:
        log_through_host(args, metrics, rollout_id, evaluation=True)
    return False


# Where each host's logger lives: a module with `log(args, metrics, step_key)` and one with
# `compute_rollout_step(args, rollout_id)` (slime 0.3: observability/; Miles: tracking_utils/).
_HOST_LOGGING = {
    "slime": ("slime.observability.logging_utils", "slime.observability.metric_utils"),
    "miles": ("miles.utils.tracking_utils.tracking", "miles.utils.metric_utils"),
}


def log_through_host(
    args: argparse.Namespace, metrics: dict[str, float], rollout_id: int, evaluation: bool
) -> None:
    """Log `metrics` with the host's own logger, on the step axis the host uses for that kind of
    rollout (`rollout/step` or `eval/step`), so they line up with the host's metrics."""
    from mrlx_plugin.core.host import HOST

    modules = _HOST_LOGGING.get(HOST or "")
    if modules is None:
        logger.info(
            "rollout %s %smulti-agent metrics: %s", rollout_id, "eval " if evaluation else "", metrics
        )
        return
    log_module = importlib.import_module(modules[0])
    step_module = importlib.import_module(modules[1])
    step_key = "eval/step" if evaluation else "rollout/step"
    step = step_module.compute_rollout_step(args, rollout_id)
    log_module.log(args, {**metrics, step_key: step}, step_key=step_key)
