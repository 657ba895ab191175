"""Per-turn credit and tree sampling, end to end through `generate` against the stub engine.

The dialogue system with two agents taking two turns each; the stub answers "\\boxed{42}" and
the label is 42, so each transcript's outcome is 1.0. Turn rewards come from a
`mrlx_turn_reward` hook module written as a user would write it.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from _hookmodule import write_hook_module
from _host import group, params, slime_args

from mrlx_plugin.core.config import ConfigError, parse_settings
from mrlx_plugin.core.host import Status
from mrlx_plugin.rewards.shaping import group_key, normalize
from mrlx_plugin.rollout import generate
from mrlx_plugin.runtime import get_runtime, runtime_for
from mrlx_plugin.settings import job_sections

AGENTS = ("asker", "answerer")


def _mrlx(**rewards):
    return {
        "run_id": "credit",
        "system": "dialogue",
        "agents": {a: {"url": "self", "sampling": {"max_new_tokens": 64}} for a in AGENTS},
        "dialogue": {"max_turns": 4},
        "rewards": {"shaping": "independent", **rewards},
        "engine": {"max_retries": 1, "request_timeout_s": 5, "sampling_seed": 7},
    }


def _run(stub, model_dir, mrlx, n=1, evaluation=False):
    async def run():
        args = slime_args(stub.url, str(model_dir), mrlx)
        try:
            outs = [await generate(args, s, params(args), evaluation=evaluation) for s in group(3, n)]
            return args, outs, (await get_runtime(args)).trained_samples_per_episode()
        finally:
            await (await get_runtime(args)).aclose()

    return asyncio.run(run())


def _stub_requests(stub) -> int:
    with urllib.request.urlopen(f"{stub.url}/_stub/stats", timeout=10) as r:
        return int(json.loads(r.read())["generate"])


FIRST_TURN_QUARTER = (
    "@hookimpl\ndef mrlx_turn_reward(episode, transcript, index, turn):\n"
    "    return 0.25 if index == 0 else None\n"
)


def test_each_turn_is_a_sample_with_its_context_and_a_discounted_return(
    stub_engine, tiny_model_dir, tmp_path, monkeypatch
):
    mrlx = _mrlx(credit="turn", gamma=0.5)
    mrlx["plugins"] = [write_hook_module(tmp_path, monkeypatch, "turns_first_quarter", FIRST_TURN_QUARTER)]
    _, [out], per_episode = _run(stub_engine, tiny_model_dir, mrlx)
    assert per_episode == 4 and len(out) == 4  # two agents x two turns
    by = {(s.metadata["mrlx"]["agent"], s.metadata["mrlx"]["turn"]): s for s in out}
    assert set(by) == {(a, t) for a in AGENTS for t in (0, 1)}
    for (agent, turn), s in by.items():
        meta = s.metadata["mrlx"]
        assert s.rollout_id == 3 and s.status == Status.COMPLETED
        assert meta["credit_group"] == f"{agent}/turn{turn}" and meta["candidate"] is False
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length > 0
        assert all(m == 1 for m in s.loss_mask)  # the turn's own ids only, every one trained
        assert len(s.weight_versions) == 1
        assert len(s.tokens) > s.response_length
    for agent in AGENTS:
        first, second = by[(agent, 0)], by[(agent, 1)]
        # The second turn's prompt is everything before it: the first turn's prompt and ids, then
        # the other agent's message; so the first sample's tokens begin the second's.
        assert second.tokens[: len(first.tokens)] == first.tokens
        assert len(second.tokens) - second.response_length > len(first.tokens)
        # outcome 1.0 at the last turn; the first turn: its own 0.25 + gamma * 1.0
        assert second.reward == pytest.approx(1.0)
        assert first.reward == pytest.approx(0.25 + 0.5 * 1.0)


def test_turns_an_episode_does_not_reach_are_aborted_fillers(stub_engine, tiny_model_dir):
    mrlx = _mrlx(credit="turn")
    mrlx["dialogue"]["stop_patterns"] = {"answerer": "boxed"}  # ends after the second turn of four
    _, outs, per_episode = _run(stub_engine, tiny_model_dir, mrlx, n=2)
    for j, out in enumerate(outs):
        assert len(out) == per_episode == 4
        real = [s for s in out if s.status != Status.ABORTED]
        fillers = [s for s in out if s.status == Status.ABORTED]
        assert sorted((s.metadata["mrlx"]["agent"], s.metadata["mrlx"]["turn"]) for s in real) == [
            ("answerer", 0),
            ("asker", 0),
        ]
        assert len(fillers) == 2 and all(not any(s.loss_mask) and s.remove_sample for s in fillers)
        assert {s.rollout_id for s in out} == {3 * 2 + j}  # the input sample's own


TURN_LOGPROB_SCORE = (
    "@hookimpl\ndef mrlx_turn_reward(episode, transcript, index, turn):\n"
    "    return round(sum(turn.logprobs), 6)\n"
)


@pytest.mark.parametrize("target", ["score", "taken_return"])
def test_tree_sampling_trains_k_candidates_per_turn_as_one_group(
    target, stub_engine, tiny_model_dir, tmp_path, monkeypatch
):
    mrlx = _mrlx(credit="turn", branch=3, gamma=1.0, branch_target=target)
    mrlx["plugins"] = [write_hook_module(tmp_path, monkeypatch, "turns_by_logprob", TURN_LOGPROB_SCORE)]
    before = _stub_requests(stub_engine)
    args, [out], per_episode = _run(stub_engine, tiny_model_dir, mrlx)
    assert _stub_requests(stub_engine) - before == 4 * 3  # four turns, three candidates each
    assert per_episode == len(out) == 2 * 2 * 3
    assert {s.metadata["mrlx"]["engine_calls"] for s in out} == {4 * 3}
    groups: dict[str, list] = {}
    for s in out:
        groups.setdefault(s.metadata["mrlx"]["credit_group"], []).append(s)
    assert len(groups) == 4 and all(len(g) == 3 for g in groups.values())
    assert {s.metadata["mrlx"]["episode"]["branch_candidates"] for s in out} == {
        4 * 2
    }  # two not taken per turn
    taken_score: dict[tuple, float] = {}
    for _name, members in groups.items():
        taken = [s for s in members if not s.metadata["mrlx"]["candidate"]]
        assert len(taken) == 1
        prompt = taken[0].tokens[: len(taken[0].tokens) - taken[0].response_length]
        for s in members:  # one context, three candidates
            assert s.tokens[: len(s.tokens) - s.response_length] == prompt
        scores = [round(sum(s.rollout_log_probs), 6) for s in members]
        assert round(sum(taken[0].rollout_log_probs), 6) == max(scores)  # the best is taken
        assert len(set(scores)) > 1  # the candidates differ (each its own seed)
        for s, score in zip(members, scores):  # a candidate not taken: its score
            if s is not taken[0] or target == "score":  # by score: the taken one too
                assert s.reward == pytest.approx(score, abs=1e-5)
        meta = taken[0].metadata["mrlx"]
        taken_score[(meta["agent"], meta["turn"])] = max(scores)
    if target == "taken_return":
        for agent in AGENTS:  # the taken turns: their own score, then the outcome (1.0), gamma 1
            rewards = {
                s.metadata["mrlx"]["turn"]: s.reward
                for s in out
                if s.metadata["mrlx"]["agent"] == agent and not s.metadata["mrlx"]["candidate"]
            }
            last = taken_score[(agent, 1)] + 1.0
            assert rewards[1] == pytest.approx(last, abs=1e-5)
            assert rewards[0] == pytest.approx(taken_score[(agent, 0)] + last, abs=1e-5)
    raw, adv = normalize(args, out)
    sums: dict = {}
    for s, a in zip(out, adv):
        sums.setdefault(group_key(s), []).append(a)
    assert len(sums) == 4 and all(abs(sum(v)) < 1e-6 for v in sums.values())


def test_evaluation_keeps_one_sample_and_no_branching(stub_engine, tiny_model_dir, tmp_path, monkeypatch):
    mrlx = _mrlx(credit="turn", branch=3)
    mrlx["plugins"] = [write_hook_module(tmp_path, monkeypatch, "turns_scored", FIRST_TURN_QUARTER)]
    before = _stub_requests(stub_engine)
    _, [out], _ = _run(stub_engine, tiny_model_dir, mrlx, evaluation=True)
    assert _stub_requests(stub_engine) - before == 4
    assert out.reward == 1.0 and out.metadata["mrlx"]["turn"] is None


def test_the_normaliser_groups_by_turn_and_role():
    class S:
        def __init__(self, group_index, meta):
            self.group_index, self.metadata = group_index, {"mrlx": meta}

    assert group_key(S(0, {"agent": "a", "credit_group": "a@p1/turn2"})) == (0, "a@p1/turn2")
    assert group_key(S(1, {"agent": "a"})) == (1, "a")  # samples of an older producer: by agent


def test_branching_without_per_turn_credit_is_refused():
    with pytest.raises(ConfigError, match="rewards.credit: turn"):
        parse_settings(_mrlx(branch=2), sections=job_sections())
    with pytest.raises(ConfigError, match="gamma"):
        parse_settings(_mrlx(credit="turn", gamma=1.5), sections=job_sections())


def test_a_turn_score_that_is_no_number_names_the_plugin(stub_engine, tiny_model_dir, tmp_path, monkeypatch):
    # A NaN or infinite score ends its episode only (tests/faults/test_nonfinite_rewards.py); a
    # score that is no number at all breaks the hook's contract on every turn.
    mrlx = _mrlx(credit="turn")
    mrlx["plugins"] = [
        write_hook_module(
            tmp_path,
            monkeypatch,
            "turns_text",
            "@hookimpl\ndef mrlx_turn_reward(episode, transcript, index, turn):\n    return 'high'\n",
        )
    ]
    with pytest.raises(ValueError, match="mrlx_turn_reward of plugin 'turns_text' returned 'high'"):
        _run(stub_engine, tiny_model_dir, mrlx)


def test_the_samples_per_episode_count_turns_and_candidates(tiny_model_dir, tmp_path, monkeypatch):
    router = "http://127.0.0.1:9"  # never called: building the runtime reads settings only
    branched = _mrlx(credit="turn", branch=2)
    branched["plugins"] = [write_hook_module(tmp_path, monkeypatch, "turns_scored", FIRST_TURN_QUARTER)]
    args = slime_args(router, str(tiny_model_dir), branched)
    assert runtime_for(args).samples_per_episode == {"asker": 4, "answerer": 4}
    mrlx = _mrlx(credit="turn")
    mrlx["dialogue"]["max_turns"] = 5  # the asker speaks first: three turns to the answerer's two
    assert runtime_for(slime_args(router, str(tiny_model_dir), mrlx)).samples_per_episode == {
        "asker": 3,
        "answerer": 2,
    }
    assert runtime_for(slime_args(router, str(tiny_model_dir), _mrlx())).samples_per_episode == {
        "asker": 1,
        "answerer": 1,
    }


def test_a_system_that_declares_no_turns_is_refused_under_per_turn_credit(
    tiny_model_dir, tmp_path, monkeypatch
):
    module = write_hook_module(
        tmp_path,
        monkeypatch,
        "turnless_system",
        "from mrlx_plugin import System\n\n"
        "async def talk(episode):\n    pass\n\n"
        "TALK = System(run=talk, fan_out=lambda settings: {'asker': 1, 'answerer': 1})\n\n"
        "@hookimpl\ndef mrlx_register_systems():\n    return {'talk': TALK}\n",
    )
    mrlx = {**_mrlx(credit="turn"), "system": "talk", "plugins": [module]}
    mrlx.pop("dialogue")
    with pytest.raises(ConfigError, match="system 'talk' declares no turns"):
        runtime_for(slime_args("http://127.0.0.1:9", str(tiny_model_dir), mrlx))


def test_candidates_differ_when_the_host_sends_its_own_seed(
    stub_engine, tiny_model_dir, tmp_path, monkeypatch
):
    """slime's deterministic inference puts one `sampling_seed` in the sampling parameters; the K
    candidates of a turn must still get K seeds, or they would be one answer K times."""
    mrlx = _mrlx(credit="turn", branch=3)
    mrlx["engine"].pop("sampling_seed")
    mrlx["plugins"] = [
        write_hook_module(tmp_path, monkeypatch, "turns_by_logprob_host_seed", TURN_LOGPROB_SCORE)
    ]

    async def run():
        args = slime_args(stub_engine.url, str(tiny_model_dir), mrlx)
        try:
            return await generate(args, group(0, 1)[0], {**params(args), "sampling_seed": 1234})
        finally:
            await (await get_runtime(args)).aclose()

    out = asyncio.run(run())
    groups: dict[str, list] = {}
    for s in out:
        groups.setdefault(s.metadata["mrlx"]["credit_group"], []).append(round(sum(s.rollout_log_probs), 6))
    assert len(groups) == 4 and all(len(set(scores)) == 3 for scores in groups.values()), groups


def test_ties_are_drawn_at_random_and_the_same_on_a_rerun():
    from types import SimpleNamespace

    from mrlx_plugin.episodes.turn import _pick

    def pick(episode_id: str, scores: list[float], how: str = "best") -> int:
        rewards = SimpleNamespace(branch_pick=how)
        episode = SimpleNamespace(id=episode_id, settings=SimpleNamespace(rewards=rewards))
        return _pick(episode, scores, SimpleNamespace(label="solver"), 0)

    ties = [pick(f"ep{i}", [0.0] * 4) for i in range(400)]
    assert all(40 <= ties.count(c) <= 160 for c in range(4)), ties  # no position favoured
    assert ties == [pick(f"ep{i}", [0.0] * 4) for i in range(400)]  # seeded: a rerun picks the same
    best = {pick(f"ep{i}", [0.0, 1.0, 1.0, 0.5]) for i in range(100)}
    assert best == {1, 2}  # only the best, either of them
    uniform = [pick(f"ep{i}", [5.0, 0.0, 0.0, 0.0], "random") for i in range(400)]
    assert all(40 <= uniform.count(c) <= 160 for c in range(4))  # the score does not matter
