"""The game system end to end, over real sockets: stub engines answer every move with a fixed text.

Nim with a stub that always answers \\boxed{1} takes one stone per move, so who wins is known
from the number of stones: with N stones the first seat takes the last one when N is odd.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from _host import params, slime_args

from mrlx_lab.stub_engine import start_stub_engine
from mrlx_plugin.core.config import ConfigError, parse_settings, settings_from_yaml
from mrlx_plugin.core.host import Sample, Status
from mrlx_plugin.core.metrics import compute_metrics
from mrlx_plugin.plugins import collect_games, collect_systems, make_plugin_manager
from mrlx_plugin.rewards.shaping import group_key, normalize
from mrlx_plugin.rollout import generate
from mrlx_plugin.runtime import get_runtime
from mrlx_plugin.settings import job_sections
from mrlx_plugin.systems.game import GAME, check_game, pool_draw

REPO = Path(__file__).resolve().parent.parent
ENGINE = {"max_retries": 0, "request_timeout_s": 10}


@pytest.fixture
def stubs(logs_dir, request):
    """Start stub engines: `stubs(text, ...)` is a started stub answering `text` (a short answer,
    the end-of-sequence id last; several texts in turn); all are stopped when the test ends."""
    started = []

    def start(*texts: str, latency: float = 0.0):  # several: request n answers texts[(n - 1) % len(texts)]
        proc = start_stub_engine(
            log_dir=logs_dir,
            name=f"stub-game-{request.node.name[:30]}-{len(started)}",
            extra=[
                *(a for text in texts for a in ("--text", text)),
                "--response-tokens",
                str(max(map(len, texts)) + 1),
                "--latency",
                str(latency),
            ],
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


def calls(stub) -> int:
    with urllib.request.urlopen(stub.url + "/_stub/stats", timeout=10) as resp:
        return json.loads(resp.read())["generate"]


def game_mrlx(agents: dict, game: dict, **more) -> dict:
    return {"run_id": "game", "system": "game", "agents": agents, "game": game, "engine": ENGINE, **more}


def episodes(
    url: str, tokenizer, mrlx: dict, prompts: list[str], per_prompt: int = 1, evaluation: bool = False
) -> list[list]:
    """Run one generate call per sample of `prompts` (`per_prompt` copies each, one prompt group
    each), as the host would; return each call's samples."""

    async def run():
        args = slime_args(url, str(tokenizer), mrlx, rollout_max_response_len=1024)
        samples = [
            Sample(group_index=g, index=g * per_prompt + j, prompt=p, label=None)
            for g, p in enumerate(prompts)
            for j in range(per_prompt)
        ]
        try:
            out = await asyncio.gather(
                *(generate(args, s, params(args), evaluation=evaluation) for s in samples)
            )
        finally:
            await (await get_runtime(args)).aclose()
        return [o if isinstance(o, list) else [o] for o in out], args

    return asyncio.run(run())


def facts(sample) -> dict:
    return sample.metadata["mrlx"]["episode"]


# --- self-play ------------------------------------------------------------------------------


def test_self_play_puts_one_agent_in_both_seats_with_a_role_each(stubs, tiny_model_dir):
    stub = stubs("\\boxed{1}")
    mrlx = game_mrlx({"p": {"url": "self"}}, {"name": "nim", "seats": ["p", "p"]})
    outs, args = episodes(stub.url, tiny_model_dir, mrlx, ["Nim: 5 stones", "Nim: 4 stones"], per_prompt=2)
    assert calls(stub) == 2 * 5 + 2 * 4  # one engine call per stone
    flat = [s for out in outs for s in out]
    for out in outs:
        assert len(out) == 2 and {s.rollout_id for s in out} == {out[0].rollout_id}
        roles = {s.metadata["mrlx"]["role"]: s for s in out}
        assert set(roles) == {"first", "second"} and {s.metadata["mrlx"]["agent"] for s in out} == {"p"}
        assert all(s.status == Status.COMPLETED for s in out)
        first, second = roles["first"], roles["second"]
        odd = facts(first)["moves"] == 5  # 5 stones, one per move: the first seat takes the last
        assert facts(first)["winner"] == ("first" if odd else "second")
        assert (first.reward, second.reward) == ((1.0, -1.0) if odd else (-1.0, 1.0))
        assert facts(first)["players"] == ["p", "p"] and facts(first)["opponent"] == "p"
        assert first.prompt[-1]["content"].startswith("Nim: ")  # the rules, once
        assert second.prompt[-1]["content"].startswith("They took 1. Nim: ")
    # each seat is its own baseline: the groups are (prompt group, agent@seat)
    assert {group_key(s) for s in flat} == {(g, f"p@{seat}") for g in (0, 1) for seat in ("first", "second")}
    _, advantages = normalize(args, flat)
    assert all(a == 0.0 for a in advantages)  # one deterministic game per prompt: no spread in a group
    metrics = compute_metrics(flat)
    assert metrics["game/episodes"] == 4 and metrics["game/illegal_rate"] == 0.0
    assert metrics["game/win_rate/first"] == metrics["game/win_rate/second"] == 0.5
    assert metrics["game/win_rate/vs/p"] == 0.5
    assert "game/draw_rate" not in metrics


def test_the_transcript_of_a_seat_holds_the_other_seats_moves(stubs, tiny_model_dir):
    stub = stubs("\\boxed{1}")
    seen = {}

    async def run():
        args = slime_args(
            stub.url,
            str(tiny_model_dir),
            game_mrlx({"p": {"url": "self"}}, {"name": "nim", "seats": ["p", "p"]}),
        )
        from mrlx_plugin.episodes import run_episode

        runtime = await get_runtime(args)
        episode, _ = await run_episode(
            runtime.context, Sample(group_index=0, index=0, prompt="Nim: 5 stones"), params(args), False
        )
        seen.update({t.role: list(t.messages) for t in episode.transcripts})
        await runtime.aclose()

    asyncio.run(run())
    first = [m["content"] for m in seen["first"] if m["role"] == "user"]
    second = [m["content"] for m in seen["second"] if m["role"] == "user"]
    assert first == [
        "Nim: 5 stones. Take 1 to 3.",
        "They took 1. 3 stones left.",
        "They took 1. 1 stones left.",
    ]
    assert second == ["They took 1. Nim: 4 stones. Take 1 to 3.", "They took 1. 2 stones left."]


# --- sample shapes --------------------------------------------------------------------------


@pytest.mark.parametrize("credit", ["episode", "turn"])
def test_every_episode_returns_the_same_number_of_samples_whatever_its_length(credit, stubs, tiny_model_dir):
    stub = stubs("\\boxed{1}")
    mrlx = game_mrlx(
        {"p": {"url": "self"}},
        {"name": "nim", "seats": ["p", "p"], "options": {"max_stones": 5}},
        rewards={"credit": credit},
    )
    settings = parse_settings(mrlx, sections=job_sections())
    assert GAME.turns(settings) == {"p": 3}  # 5 stones: the first seat moves at most 3 times
    outs, _ = episodes(stub.url, tiny_model_dir, mrlx, ["Nim: 1 stones", "Nim: 2 stones", "Nim: 5 stones"])
    per_episode = 2 if credit == "episode" else 2 * 3
    assert [len(out) for out in outs] == [per_episode] * 3
    real = [[s for s in out if s.status != Status.ABORTED] for out in outs]
    fillers = [[s for s in out if s.status == Status.ABORTED] for out in outs]
    if credit == "episode":
        # one stone: the second seat never moves, its transcript is a filler
        assert [len(r) for r in real] == [1, 2, 2]
    else:
        assert [len(r) for r in real] == [1, 2, 5]  # one sample per move made
        for r in real:
            for s in r:
                m = s.metadata["mrlx"]
                assert m["turn"] is not None and s.loss_mask == [1] * s.response_length
                # gamma 1: every turn of the winner is worth +1, of the loser -1 (moves earn nothing
                # of their own)
                assert s.reward == (1.0 if m["role"] == facts(s)["winner"] else -1.0)
        assert compute_metrics([s for out in outs for s in out])["credit/turn_samples"] == 8
    for f in fillers:
        for s in f:
            assert s.loss_mask == [0] * s.response_length and s.reward == 0.0 and s.remove_sample


# --- legality -------------------------------------------------------------------------------


@pytest.mark.parametrize("answer", ["\\boxed{7}", "I take one stone."])
def test_an_illegal_move_ends_the_episode_with_the_penalty_and_is_counted(answer, stubs, tiny_model_dir):
    stub = stubs(answer)
    mrlx = game_mrlx({"p": {"url": "self"}}, {"name": "nim", "seats": ["p", "p"], "illegal_penalty": -2.5})
    outs, _ = episodes(stub.url, tiny_model_dir, mrlx, ["Nim: 5 stones"], per_prompt=2)
    assert calls(stub) == 2  # the first move of each episode, and no more
    for out in outs:
        first = next(s for s in out if s.status != Status.ABORTED)
        assert first.metadata["mrlx"]["role"] == "first" and first.reward == -2.5
        assert facts(first)["illegal_move"] == "first" and facts(first)["outcome"] == [-2.5, 0.0]
        assert facts(first)["winner"] == "second" and facts(first)["moves"] == 1
        assert [s.status for s in out].count(Status.ABORTED) == 1  # the second seat never moved
    metrics = compute_metrics([s for out in outs for s in out])
    assert metrics["game/illegal_rate"] == 1.0 and metrics["game/win_rate/second"] == 1.0


def test_a_frozen_opponents_illegal_move_is_a_win_for_the_trained_seat(stubs, tiny_model_dir):
    me, them = stubs("\\boxed{1}"), stubs("\\boxed{9}")
    mrlx = game_mrlx(
        {"p": {"url": "self"}, "opp": {"url": them.url, "trainable": False}},
        {"name": "nim", "seats": ["p", "opp"]},
    )
    outs, _ = episodes(me.url, tiny_model_dir, mrlx, ["Nim: 6 stones"])
    (s,) = outs[0]
    assert s.reward == 0.0 and facts(s)["illegal_move"] == "second" and facts(s)["winner"] == "first"
    assert (calls(me), calls(them)) == (1, 1)


def test_a_game_cut_short_by_max_turns_is_a_draw(stubs, tiny_model_dir):
    stub = stubs("\\boxed{1}")
    mrlx = game_mrlx({"p": {"url": "self"}}, {"name": "nim", "seats": ["p", "p"], "max_turns": 3})
    outs, _ = episodes(stub.url, tiny_model_dir, mrlx, ["Nim: 5 stones", "Nim: 2 stones"])
    assert calls(stub) == 3 + 2
    cut, done = outs
    assert [s.reward for s in cut] == [0.0, 0.0] and facts(cut[0])["stopped_by"] == "max_turns"
    assert facts(cut[0])["winner"] is None and facts(cut[0])["moves"] == 3
    assert facts(done[0])["winner"] == "second"
    metrics = compute_metrics([s for out in outs for s in out])
    assert metrics["game/draw_rate"] == 0.5 and metrics["game/win_rate/second"] == 0.5


# --- a frozen opponent ----------------------------------------------------------------------


def test_a_frozen_opponent_plays_from_its_own_url_and_returns_no_samples(stubs, tiny_model_dir):
    me, frozen = stubs("\\boxed{1}"), stubs("\\boxed{2}")
    mrlx = game_mrlx(
        {"p": {"url": "self"}, "frozen": {"url": frozen.url, "trainable": False}},
        {"name": "nim", "seats": ["p", "frozen"]},
    )
    # 7 stones: p takes 1 (6 left), frozen 2 (4), p 1 (3), frozen 2 (1), p takes the last
    outs, _ = episodes(me.url, tiny_model_dir, mrlx, ["Nim: 7 stones"], per_prompt=3)
    assert (calls(me), calls(frozen)) == (3 * 3, 3 * 2)
    for out in outs:
        assert [s.metadata["mrlx"]["agent"] for s in out] == ["p"]
        assert out[0].reward == 1.0 and facts(out[0])["opponent"] == "frozen"
        assert out[0].status == Status.COMPLETED and sum(out[0].loss_mask) > 0
    assert compute_metrics([out[0] for out in outs])["game/win_rate/vs/frozen"] == 1.0


# --- an opponent pool -----------------------------------------------------------------------


def test_the_pool_draws_an_opponent_per_episode_deterministically(stubs, tiny_model_dir):
    me, past = stubs("\\boxed{1}"), stubs("\\boxed{2}")
    opponents = ["past", "script:random", "script:optimal"]
    mrlx = game_mrlx(
        {"p": {"url": "self"}, "past": {"url": past.url, "trainable": False}},
        {"name": "nim", "seats": ["p", "pool"], "opponents": opponents},
    )
    prompts = ["Nim: 7 stones"] * 6
    outs, _ = episodes(me.url, tiny_model_dir, mrlx, prompts, per_prompt=3)
    again, _ = episodes(me.url, tiny_model_dir, mrlx, prompts, per_prompt=3)
    drawn = [facts(out[0])["opponent"] for out in outs]
    assert drawn == [facts(out[0])["opponent"] for out in again]  # the same draws on a rerun
    # one draw per prompt group: its episodes compare like with like
    assert drawn == [pool_draw(f"{mrlx['run_id']}:group{out[0].group_index}", opponents, 1) for out in outs]
    for group in {out[0].group_index for out in outs}:
        assert len({d for d, out in zip(drawn, outs) if out[0].group_index == group}) == 1
    assert set(drawn) == set(opponents), drawn  # 18 episodes meet every opponent
    assert all(len(out) == 1 and out[0].metadata["mrlx"]["agent"] == "p" for out in outs)
    assert calls(past) == 2 * 2 * drawn.count("past")  # two moves per game against it, two runs
    metrics = compute_metrics([out[0] for out in outs])
    # 7 stones, p always takes 1: the past checkpoint (takes 2) loses, the optimal player wins
    assert metrics["game/win_rate/vs/past"] == 1.0 and metrics["game/win_rate/vs/script:optimal"] == 0.0
    assert 0.0 <= metrics["game/win_rate/vs/script:random"] <= 1.0
    assert metrics["game/episodes"] == 18


# --- credit and tree sampling ---------------------------------------------------------------


@pytest.mark.parametrize("branch_score", ["rollout", "settle"])
def test_tree_sampling_goes_on_from_the_right_step_of_a_chain(branch_score, stubs, tiny_model_dir):
    # Request i answers \boxed{i}: of the 4 candidates of a turn exactly one is right.
    stub = stubs("\\boxed{{i}}")
    mrlx = game_mrlx(
        {"solver": {"url": "self"}},
        {"name": "chain", "options": {"max_steps": 3}, "branch_score": branch_score},
        rewards={"credit": "turn", "gamma": 0.9, "branch": 4},
    )
    # Turn 0: requests 0-3, the right 3. Its rollout (branch_score: rollout) plays the next step
    # with one call, request 4: wrong, so the chain it plays out fails there. Turn 1: requests
    # 4-7 (5-8 after a rollout), the right 7, which ends the chain: nothing left to roll out.
    outs, _ = episodes(stub.url, tiny_model_dir, mrlx, ["Chain: 1 +2 +4"])
    (out,) = outs
    rollouts = 1 if branch_score == "rollout" else 0
    assert calls(stub) == 8 + rollouts and len(out) == 1 * 3 * 4  # transcripts x turns x branch
    real = [s for s in out if s.status != Status.ABORTED]
    assert len(real) == 8 and facts(real[0])["winner"] == "solver" and facts(real[0])["outcome"] == [1.0]
    assert facts(real[0])["branch_candidates"] == 6
    assert real[0].metadata["mrlx"]["engine_calls"] == 8 + rollouts
    taken = {s.metadata["mrlx"]["turn"]: s for s in real if not s.metadata["mrlx"]["candidate"]}
    assert taken[0].response.startswith("\\boxed{3}") and taken[1].response.startswith("\\boxed{7}")
    # Every candidate trains on its score. Turn 1's right step ends the chain: its own 1 and the
    # outcome 1. Turn 0's right step: its own 1, and by rollout 0.9 x its played-out future (a
    # wrong step: 0), or settled at once (the step does not end the chain: its own 1). Either
    # way not the return the episode went on to realise (1 + 0.9 x 2), which a rollout of the
    # same policy need not reach.
    assert taken[1].reward == pytest.approx(2.0) and taken[0].reward == pytest.approx(1.0)
    # the wrong candidates ended the chain (a wrong step: own 0, outcome 0)
    assert [s.reward for s in real if s.metadata["mrlx"]["candidate"]] == [0.0] * 6
    groups = {s.metadata["mrlx"]["credit_group"] for s in real}
    assert len(groups) == 2  # the 4 candidates of each turn are one group
    metrics = compute_metrics(out)
    assert metrics["credit/branch_candidates"] == 6 and metrics["credit/turn_samples"] == 8
    assert metrics["multi_agent/engine_calls"] == 8 + rollouts
    assert metrics["game/win_rate/solver"] == 1.0


@pytest.mark.parametrize("target", ["score", "taken_return"])
def test_equal_candidates_get_equal_advantages(target, stubs, tiny_model_dir):
    # Turn 0 of "Chain: 1 +2 +4" (3, then 7) gets candidates 3, 3, 0, 0: two equal right answers,
    # one of which the episode goes on from; turn 1 gets 7, 0, 0, 0 and the chain succeeds.
    stub = stubs(*(f"\\boxed{{{n}}}" for n in (3, 3, 0, 0, 7, 0, 0, 0)))
    mrlx = game_mrlx(
        {"solver": {"url": "self"}},
        {"name": "chain", "options": {"max_steps": 2}, "branch_score": "settle"},
        rewards={"credit": "turn", "gamma": 0.9, "branch": 4, "branch_target": target},
    )
    outs, args = episodes(stub.url, tiny_model_dir, mrlx, ["Chain: 1 +2 +4"])
    (out,) = outs
    _, advantages = normalize(args, out)
    first = [(s, a) for s, a in zip(out, advantages) if s.metadata["mrlx"]["turn"] == 0]
    right = [(s.reward, a) for s, a in first if s.response.startswith("\\boxed{3}")]
    assert len(right) == 2 and len(first) == 4
    if target == "score":  # both trained on their score: the same reward, the same advantage
        assert right[0] == pytest.approx(right[1]) and right[0][0] == pytest.approx(1.0)
        assert right[0][1] > 0
    else:  # the bias it keeps: the taken one on its return (1 + 0.9 x 2), its twin on its score
        assert sorted(r for r, _ in right) == pytest.approx([1.0, 1.0 + 0.9 * 2.0])
        assert right[0][1] != pytest.approx(right[1][1])


@pytest.mark.parametrize("target", ["score", "taken_return"])
def test_the_winning_move_is_not_pushed_down_for_not_being_taken(target, stubs, tiny_model_dir):
    # Nim from 6 stones, one model in both seats, every answer "take 2": 6 -> 4 -> 2 -> 0, the
    # first seat wins. Each turn's two candidates are the same move; the first seat's first is
    # the only winning move from 6 (it leaves a multiple of 4).
    # `taken_return` with `settle` scores is the estimator before `score` and rollouts.
    stub = stubs("\\boxed{2}")
    scored = "rollout" if target == "score" else "settle"
    mrlx = game_mrlx(
        {"player": {"url": "self"}},
        {"name": "nim", "seats": ["player", "player"], "branch_score": scored},
        rewards={"credit": "turn", "gamma": 1.0, "branch": 2, "branch_target": target},
    )
    outs, args = episodes(stub.url, tiny_model_dir, mrlx, ["Nim: 6 stones"])
    (out,) = outs
    _, advantages = normalize(args, out)
    opening = [
        (s.reward, a)
        for s, a in zip(out, advantages)
        if s.status != Status.ABORTED
        and s.metadata["mrlx"]["role"] == "first"
        and s.metadata["mrlx"]["turn"] == 0
    ]
    assert len(opening) == 2
    if target == "score":  # both rolled out to the win: +1 each, advantage 0 for both
        assert opening == [(1.0, pytest.approx(0.0)), (1.0, pytest.approx(0.0))]
    else:  # the taken one on the win it led to, its twin on what it settles at once (0): pushed down
        assert sorted(r for r, _ in opening) == [0.0, 1.0]
        assert min(a for _, a in opening) < 0


def test_a_rollout_is_not_cut_by_the_grade_deadline(stubs, tiny_model_dir):
    # Nim from 6 stones by self-play, every answer "take 2", each engine call 0.3 s: the first
    # move's rollout plays two more moves (0.6 s), past a 0.5 s grade deadline. The deadline is
    # the mrlx_turn_reward hook's; a rollout's calls have deadlines of their own.
    stub = stubs("\\boxed{2}", latency=0.3)
    mrlx = game_mrlx(
        {"player": {"url": "self"}},
        {"name": "nim", "seats": ["player", "player"]},
        rewards={"credit": "turn", "branch": 2, "grade_timeout_s": 0.5},
    )
    outs, _ = episodes(stub.url, tiny_model_dir, mrlx, ["Nim: 6 stones"])
    (out,) = outs
    assert all(not s.metadata["mrlx"]["aborted"] for s in out)
    assert facts(out[0])["winner"] == "first"


@pytest.mark.parametrize(
    "rewards, system, message",
    [
        ({"shaping": "cooperative"}, "game", "mrlx.rewards.shaping is 'cooperative'"),
        ({}, "dialogue", "no plugin implements mrlx_turn_reward"),
    ],
)
def test_tree_sampling_is_refused_where_its_scores_would_miss_a_reward(
    rewards, system, message, tiny_model_dir
):
    # A candidate trains on its score: a game's own numbers (no shaping reaches them), or the
    # mrlx_turn_reward hook's (without one, every candidate 0.0 and the outcome reaches none).
    mrlx = game_mrlx(
        {"player": {"url": "self"}},
        {"name": "nim", "seats": ["player", "player"]},
        rewards={"credit": "turn", "branch": 2, **rewards},
    )
    if system == "dialogue":
        mrlx = {k: v for k, v in mrlx.items() if k != "game"} | {"system": "dialogue"}
        mrlx["agents"] = {"asker": {"url": "self"}, "answerer": {"url": "self"}}
    with pytest.raises(ConfigError, match=re.escape(message)):
        asyncio.run(get_runtime(slime_args("http://127.0.0.1:9", str(tiny_model_dir), mrlx)))


@pytest.mark.parametrize("group_by", ["observation", "index"])
def test_turns_are_compared_with_the_turns_that_saw_the_same(group_by, stubs, tiny_model_dir):
    # Kuhn poker by self-play, every answer "check": 8 episodes of one prompt group, each dealt
    # its own cards. The first seat's opening turns are grouped by what it saw (its card), or
    # with `group_turns_by: index` all together.
    stub = stubs("\\boxed{check}")
    mrlx = game_mrlx(
        {"player": {"url": "self"}},
        {"name": "kuhn_poker", "seats": ["player", "player"]},
        rewards={"credit": "turn", "group_turns_by": group_by},
    )
    outs, _ = episodes(stub.url, tiny_model_dir, mrlx, ["Kuhn poker"], per_prompt=8)
    groups: dict[str, set[str]] = {}
    for s in (s for out in outs for s in out):
        meta = s.metadata["mrlx"]
        if s.status != Status.ABORTED and meta["role"] == "first" and meta["turn"] == 0:
            card = s.prompt[-1]["content"].split("Your card: ")[1][0]
            groups.setdefault(meta["credit_group"], set()).add(card)
    if group_by == "index":
        assert len(groups) == 1 and len(next(iter(groups.values()))) >= 2
        return
    assert len(groups) >= 2  # 8 deals hold at least two of the three cards
    assert all(len(cards) == 1 for cards in groups.values())  # one card per group


def test_a_wrong_step_ends_the_chain_with_outcome_zero(stubs, tiny_model_dir):
    stub = stubs("\\boxed{3}")
    mrlx = game_mrlx({"solver": {"url": "self"}}, {"name": "chain"}, rewards={"credit": "turn", "gamma": 0.5})
    outs, _ = episodes(stub.url, tiny_model_dir, mrlx, ["Chain: 1 +2 +4 +1"])
    (out,) = outs
    real = [s for s in out if s.status != Status.ABORTED]
    assert calls(stub) == 2 and len(out) == 3 and len(real) == 2
    assert [s.reward for s in real] == [pytest.approx(1.0), 0.0]  # right (1 + 0.5 * 0), then wrong (0)
    assert facts(real[0])["outcome"] == [0.0] and facts(real[0])["winner"] is None
    assert compute_metrics(out)["game/win_rate/solver"] == 0.0


# --- evaluation, configs, the command -------------------------------------------------------


def test_evaluation_reports_the_first_seats_outcome(stubs, tiny_model_dir):
    stub = stubs("\\boxed{1}")
    mrlx = game_mrlx({"p": {"url": "self"}}, {"name": "nim", "seats": ["p", "script:optimal"]})
    outs, _ = episodes(stub.url, tiny_model_dir, mrlx, ["Nim: 5 stones", "Nim: 3 stones"], evaluation=True)
    # 5: p takes 1, optimal takes 0 mod 4 -> random; 3: p takes 1, optimal takes 2 and wins
    assert outs[1][0].reward == -1.0 and facts(outs[1][0])["opponent"] == "script:optimal"
    assert all(len(out) == 1 and out[0].reward in (1.0, -1.0) for out in outs)


def test_the_trained_agent_is_the_reported_seat_even_when_a_frozen_model_moves_first(stubs, tiny_model_dir):
    me, frozen = stubs("\\boxed{1}"), stubs("\\boxed{2}")
    mrlx = game_mrlx(
        {"p": {"url": "self"}, "opp": {"url": frozen.url, "trainable": False}},
        {"name": "nim", "seats": ["opp", "p"]},
    )
    # 5 stones: opp takes 2 (3 left), p 1 (2), opp takes 2 and wins
    outs, _ = episodes(me.url, tiny_model_dir, mrlx, ["Nim: 5 stones"], evaluation=True)
    ((out,),) = outs
    assert out.metadata["mrlx"]["agent"] == "p" and out.reward == -1.0
    assert facts(out)["first_seat"] == "second" and facts(out)["opponent"] == "opp"
    assert compute_metrics([out])["game/win_rate/vs/opp"] == 0.0


def test_a_config_that_does_not_fit_the_game_is_refused_at_start_up(tiny_model_dir):
    bad = [
        ({"name": "nim", "seats": ["p"]}, "game 'nim' has 2 seat(s) (first, second); got 1 player(s)"),
        (
            {"name": "nim", "seats": ["p", "script:genius"]},
            "mrlx.game.seats[1]: game 'nim' has no scripted player",
        ),
        (
            {"name": "nim", "seats": ["p", "p"], "options": {"max_stone": 3}},
            "'max_stone' is no option of nim",
        ),
    ]
    for game, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            asyncio.run(
                get_runtime(
                    slime_args(
                        "http://127.0.0.1:9", str(tiny_model_dir), game_mrlx({"p": {"url": "self"}}, game)
                    )
                )
            )


def test_a_game_registered_by_a_plugin_is_played(stubs, tiny_model_dir, tmp_path, monkeypatch):
    (tmp_path / "guess_game.py").write_text(
        "from mrlx_plugin import hookimpl\n"
        "from mrlx_plugin.systems.game import Game\n\n"
        "class Guess(Game):\n"
        "    seats = ('guesser',)\n"
        "    def start(self, problem, label, rng, options):\n"
        "        return {'secret': int(label), 'guess': None}\n"
        "    def to_move(self, state):\n"
        "        return 0 if state['guess'] is None else None\n"
        "    def observation(self, state, seat):\n"
        "        return 'Guess a number from 1 to 3: \\\\boxed{N}.'\n"
        "    def legal_moves(self, state, seat):\n"
        "        return [1, 2, 3]\n"
        "    def play(self, state, seat, move):\n"
        "        return {**state, 'guess': move}\n"
        "    def outcome(self, state):\n"
        "        return [1.0 if state['guess'] == state['secret'] else 0.0]\n"
        "    def max_moves(self, options):\n"
        "        return {0: 1}\n\n"
        "@hookimpl\n"
        "def mrlx_register_games():\n"
        "    return {'guess': Guess()}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    stub = stubs("\\boxed{2}")
    mrlx = game_mrlx({"g": {"url": "self"}}, {"name": "guess", "max_turns": 1}, plugins=["guess_game"])

    async def run():
        args = slime_args(stub.url, str(tiny_model_dir), mrlx)
        try:
            return [
                await generate(
                    args, Sample(group_index=0, index=i, prompt="guess", label=str(i + 1)), params(args)
                )
                for i in range(3)
            ]
        finally:
            await (await get_runtime(args)).aclose()

    outs = asyncio.run(run())
    assert [out[0].reward for out in outs] == [0.0, 1.0, 0.0]
    assert facts(outs[1][0])["game"] == "guess" and facts(outs[1][0])["winner"] == "guesser"


def test_every_example_game_config_loads_through_the_real_loader():
    pm = make_plugin_manager([])
    systems, games = set(collect_systems(pm)), collect_games(pm)
    paths = sorted((REPO / "examples" / "games").glob("*.yaml"))
    assert {p.name for p in paths} >= {
        "nim_selfplay.yaml",
        "nim_frozen.yaml",
        "nim_pool.yaml",
        "kuhn_poker.yaml",
        "chain_turn_credit.yaml",
    }
    for path in paths:
        settings = settings_from_yaml(path, known_systems=systems, sections=job_sections())
        assert settings.system == "game"
        assert not check_game(settings, games)  # the seats fit the game
        assert GAME.fan_out(settings) and GAME.turns(settings)
    for name, rows in (("nim", 64), ("chain", 64), ("kuhn", 64)):
        from mrlx_plugin.local.trainer.tasks import task_prompts

        lines = (REPO / "examples" / "games" / f"{name}_prompts.jsonl").read_text().splitlines()
        task = {"kuhn": "kuhn_poker"}.get(name, name)
        assert [tuple(json.loads(line).values()) for line in lines] == task_prompts(task, rows, seed=0)


def test_mrlx_rollout_runs_a_game_config(stubs, tiny_model_dir, tmp_path):
    stub = stubs("\\boxed{1}")
    out = tmp_path / "samples.jsonl"
    argv = [
        sys.executable,
        "-m",
        "mrlx_plugin.cli",
        "rollout",
        "--config",
        "examples/games/nim_selfplay.yaml",
        "--router-url",
        stub.url,
        "--hf-checkpoint",
        str(tiny_model_dir),
        "--prompt-data",
        "examples/games/nim_prompts.jsonl",
        "--rollout-batch-size",
        "3",
        "--n-samples-per-prompt",
        "2",
        "--output",
        str(out),
    ]
    r = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "6 episodes, 12 samples" in r.stdout and "game/win_rate/first" in r.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(row["metadata"]["mrlx"]["role"] for row in rows) == ["first"] * 6 + ["second"] * 6
    assert all(row["status"] == "completed" and row["reward"] in (1.0, -1.0) for row in rows)
    r = subprocess.run(
        argv + ["--evaluation"], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # 9, 6 and 9 stones, one at a time: the first seat wins the odd piles
    assert [row["reward"] for row in rows] == [1.0, 1.0, -1.0, -1.0, 1.0, 1.0]
