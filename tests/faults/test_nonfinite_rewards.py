"""Rewards that are not finite numbers, and an opponent-pool member that is down, over real sockets.

A reward that is NaN or infinite is never trained on, nor replaced by 0.0: wherever it is made (a
game's `move_reward` or `outcome`, the `mrlx_turn_reward`, `mrlx_grade` or `mrlx_shape_rewards`
hook, a reward setting that reaches the episode) the episode ends ABORTED, as for a failed grade
(reward 0.0, loss mask all zero, `remove_sample`), counted in `multi_agent/aborted_episodes`,
and the reason (in every sample's `abort_reason` and the log) names who made the value: the
plugin module, or the game and the plugin that registered it, or the setting.

A frozen opponent-pool member whose URL refuses connections ends its episodes at once (not after
`engine.peer_deadline_s`, here 600 s against the test's own 120 s timeout), counted as
`multi_agent/opponent_down`; for a while after, the episodes that draw it end without a call.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket

import pytest
from _hookmodule import write_hook_module
from _host import generate_all, group, params, slime_args

from mrlx_lab.stub_engine import start_stub_engine
from mrlx_plugin.core.host import Sample, Status
from mrlx_plugin.core.metrics import compute_metrics
from mrlx_plugin.rewards.shaping import normalize
from mrlx_plugin.rollout import generate
from mrlx_plugin.runtime import get_runtime, runtime_for
from mrlx_plugin.systems.game import pool_draw

ENGINE = {"max_retries": 0, "request_timeout_s": 10, "sampling_seed": 7}


@pytest.fixture
def stubs(logs_dir, request):
    """Start stub engines: `stubs(text)` is a started stub answering `text`; all stopped at the end."""
    started = []

    def start(text: str):
        name = f"nonfinite-{request.node.name[:30]}-{len(started)}"
        started.append(
            start_stub_engine(
                log_dir=logs_dir, name=name, extra=["--text", text, "--response-tokens", str(len(text) + 1)]
            )
        )
        return started[-1]

    yield start
    for proc in started:
        proc.stop()


def run(url: str, tokenizer, mrlx: dict, samples: list[Sample], settings=None) -> list[list]:
    """One `generate` call per sample, concurrently, as the host makes them; each call's samples.
    `settings(runtime_settings)` may change the loaded settings first (a value no loader lets in)."""

    args = slime_args(url, str(tokenizer), mrlx, rollout_max_response_len=256)
    if settings is not None:
        settings(runtime_for(args).settings)
    return generate_all(args, samples)


def samples_of(
    groups: int, per_group: int, prompt: str = "What is 40 + 2?", label: str = "42"
) -> list[Sample]:
    return [s for g in range(groups) for s in group(g, per_group, prompt, label)]


def assert_aborted_naming(outs: list[list], caplog, *names: str) -> None:
    """Every sample ABORTED (nothing trained, no 0.0 put in a bad value's place), every episode
    counted, and the reason, in the samples and in the log, naming each of `names`."""
    flat = [s for out in outs for s in out]
    for s in flat:
        assert s.status == Status.ABORTED and s.remove_sample and set(s.loss_mask) <= {0}, s.metadata["mrlx"]
        assert s.reward == 0.0
        reason = s.metadata["mrlx"]["abort_reason"]
        assert reason and all(name in reason for name in names), reason
    assert compute_metrics(flat)["multi_agent/aborted_episodes"] == len(outs)
    logged = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert all(name in logged for name in names), logged


# --- a game of a plugin ---------------------------------------------------------------------

GAME = """
from mrlx_plugin.systems.game import Game


class Steps(Game):
    \"\"\"One seat, two moves; the stub's answer (\\\\boxed{{42}}) is the only legal move.\"\"\"

    seats = ("stepper",)
    perfect_information = True  # tree sampling plays on from the true state

    def start(self, problem, label, rng, options):
        return 0

    def to_move(self, state):
        return 0 if state < 2 else None

    def observation(self, state, seat):
        return f"Step {{state}}: answer \\\\boxed{{{{42}}}}."

    def legal_moves(self, state, seat):
        return [42]

    def play(self, state, seat, move):
        return state + 1

    def move_reward(self, state, seat, move, next_state):
        return {move_reward}

    def outcome(self, state):
        return {outcome}

    def max_moves(self, options):
        return {{0: 2}}


@hookimpl
def mrlx_register_games():
    return {{"steps": Steps()}}
"""


SHOWN = {"math.nan": "nan", "math.inf": "inf", "-math.inf": "-inf"}  # each value as the messages show it


def game_config(module: str, **rewards) -> dict:
    return {
        "run_id": "nonfinite-game",
        "system": "game",
        "plugins": [module],
        "agents": {"player": {"url": "self"}},
        "game": {"name": "steps", "max_turns": 2},
        "rewards": rewards,
        "engine": ENGINE,
    }


@pytest.mark.parametrize("branch", [1, 2])
@pytest.mark.parametrize("bad", ["math.nan", "math.inf", "-math.inf"])
def test_a_move_reward_that_is_not_finite_aborts_naming_the_game_and_its_plugin(
    bad, branch, stub_engine, tiny_model_dir, tmp_path, monkeypatch, caplog
):
    module = f"steps_move_{bad.replace('-', 'minus_').replace('.', '_')}_{branch}"
    write_hook_module(
        tmp_path,
        monkeypatch,
        module,
        GAME.format(move_reward=f"{bad} if state == 1 else 0.5", outcome="[1.0]"),
    )
    outs = run(
        stub_engine.url, tiny_model_dir, game_config(module, credit="turn", branch=branch), samples_of(2, 2)
    )
    assert [len(out) for out in outs] == [2 * branch] * 4  # the fixed fan-out: 2 turns x branch
    assert_aborted_naming(outs, caplog, "game 'steps'", f"plugin '{module}'", "move_reward", SHOWN[bad])


@pytest.mark.parametrize("credit", ["episode", "turn"])
def test_an_outcome_that_is_not_finite_aborts_naming_the_game_and_its_plugin(
    credit, stub_engine, tiny_model_dir, tmp_path, monkeypatch, caplog
):
    module = f"steps_outcome_nan_{credit}"
    write_hook_module(tmp_path, monkeypatch, module, GAME.format(move_reward="0.5", outcome="[math.nan]"))
    outs = run(stub_engine.url, tiny_model_dir, game_config(module, credit=credit), samples_of(2, 2))
    assert_aborted_naming(outs, caplog, "game 'steps'", f"plugin '{module}'", "outcome", "nan")
    assert "mrlx_plugin.defaults" not in outs[0][0].metadata["mrlx"]["abort_reason"]


def test_an_illegal_move_penalty_that_is_not_finite_is_blamed_on_the_setting(stubs, tiny_model_dir, caplog):
    stub = stubs("\\boxed{9}")  # no legal move in nim
    mrlx = {
        "run_id": "nonfinite-penalty",
        "system": "game",
        "agents": {"p": {"url": "self"}},
        "game": {"name": "nim", "seats": ["p", "script:random"]},
        "engine": ENGINE,
    }

    def nan_penalty(settings):  # the loader's bounds aside: a value that reaches the episode
        settings.game.illegal_penalty = math.nan

    outs = run(stub.url, tiny_model_dir, mrlx, samples_of(1, 2, "Nim: 5 stones", ""), nan_penalty)
    assert_aborted_naming(outs, caplog, "mrlx.game.illegal_penalty", "nan")


# --- the hooks ------------------------------------------------------------------------------


def dialogue_config(module: str, **rewards) -> dict:
    return {
        "run_id": "nonfinite-hooks",
        "system": "dialogue",
        "plugins": [module],
        "agents": {a: {"url": "self"} for a in ("asker", "answerer")},
        "dialogue": {"max_turns": 4},
        "rewards": rewards,
        "engine": ENGINE,
    }


@pytest.mark.parametrize("branch", [1, 2])
@pytest.mark.parametrize("bad", ["math.nan", "math.inf"])
def test_a_turn_reward_that_is_not_finite_aborts_naming_the_plugin(
    bad, branch, stub_engine, tiny_model_dir, tmp_path, monkeypatch, caplog
):
    module = f"turn_reward_{bad.replace('.', '_')}_{branch}"
    write_hook_module(
        tmp_path,
        monkeypatch,
        module,
        (
            "@hookimpl\ndef mrlx_turn_reward(episode, transcript, index, turn):\n"
            f"    return {bad} if index == 1 else 0.25\n"
        ),
    )
    outs = run(
        stub_engine.url,
        tiny_model_dir,
        dialogue_config(module, credit="turn", branch=branch),
        samples_of(2, 2),
    )
    assert_aborted_naming(outs, caplog, f"mrlx_turn_reward of plugin '{module}'", SHOWN[bad])


@pytest.mark.parametrize("credit", ["episode", "turn"])
def test_a_shaped_reward_that_is_not_finite_aborts_naming_the_plugin(
    credit, stub_engine, tiny_model_dir, tmp_path, monkeypatch, caplog
):
    module = f"shape_nan_{credit}"
    write_hook_module(
        tmp_path,
        monkeypatch,
        module,
        (
            "@hookimpl\ndef mrlx_shape_rewards(episode):\n"
            "    return {i: (math.nan if i == 0 else t.raw_reward) for i, t in "
            "enumerate(episode.transcripts)\n"
            "            if t.raw_reward is not None}\n"
        ),
    )
    outs = run(stub_engine.url, tiny_model_dir, dialogue_config(module, credit=credit), samples_of(2, 2))
    assert_aborted_naming(outs, caplog, f"mrlx_shape_rewards of plugin '{module}'", "nan")


def test_a_grade_that_is_not_finite_aborts_naming_the_plugin(
    stub_engine, tiny_model_dir, tmp_path, monkeypatch, caplog
):
    module = "grade_inf"
    write_hook_module(
        tmp_path,
        monkeypatch,
        module,
        (
            "@hookimpl\nasync def mrlx_grade(agent, transcript, episode):\n"
            "    return -math.inf if agent == 'answerer' else None\n"
        ),
    )
    outs = run(stub_engine.url, tiny_model_dir, dialogue_config(module), samples_of(1, 2))
    assert_aborted_naming(
        outs, caplog, "grading agent 'answerer'", f"mrlx_grade of plugin '{module}'", "-inf"
    )


def test_a_shaping_setting_that_is_not_finite_is_blamed_on_the_setting(stub_engine, tiny_model_dir, caplog):
    mrlx = {
        "run_id": "nonfinite-coupling",
        "system": "dialogue",
        "agents": {a: {"url": "self"} for a in ("asker", "answerer")},
        "dialogue": {"max_turns": 2},
        "engine": ENGINE,
        "rewards": {"shaping": "asymmetric", "coupling": {"asker": {"asker": 1.0, "answerer": 0.5}}},
    }

    def nan_weight(settings):
        settings.rewards.coupling["asker"]["answerer"] = math.nan

    outs = run(stub_engine.url, tiny_model_dir, mrlx, samples_of(1, 2), nan_weight)
    assert_aborted_naming(outs, caplog, "mrlx.rewards.coupling", "nan")


def test_a_debate_reward_setting_that_is_not_finite_is_blamed_on_the_setting(stubs, tiny_model_dir, caplog):
    stub = stubs("Winner: A")
    mrlx = {
        "run_id": "nonfinite-debate",
        "system": "debate",
        "engine": ENGINE,
        "debate": {"rounds": 1},
        "agents": {
            "pro": {"url": "self"},
            "con": {"url": "self"},
            "judge": {"url": stub.url, "trainable": False},
        },
    }

    def nan_win(settings):
        settings.debate.win_reward = math.nan

    outs = run(stub.url, tiny_model_dir, mrlx, samples_of(1, 2), nan_win)
    assert_aborted_naming(outs, caplog, "mrlx.debate.win_reward", "nan")


def test_the_normaliser_refuses_a_reward_that_is_not_finite_naming_the_sample():
    samples = [
        Sample(
            group_index=0,
            index=i,
            prompt="p",
            label=None,
            reward=r,
            metadata={"mrlx": {"agent": "solver", "episode_id": f"run:{i}"}},
        )
        for i, r in enumerate([1.0, math.nan])
    ]
    args = type("Args", (), {"advantage_estimator": "grpo", "reward_key": None})()
    with pytest.raises(ValueError, match=r"sample 1 .*agent 'solver'.*episode 'run:1'.*reward nan"):
        normalize(args, samples)


# --- an opponent-pool member that is down ---------------------------------------------------


@pytest.fixture
def refusing_url():
    """An http URL whose port refuses connections: bound (so nothing else takes it), not listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.mark.timeout(120)  # far below peer_deadline_s: a member waited on until the deadline fails the test
def test_a_pool_member_that_is_down_fails_its_episodes_at_once(stubs, tiny_model_dir, refusing_url, caplog):
    me = stubs("\\boxed{1}")  # p takes one stone per move
    opponents = ["past", "script:random"]
    mrlx = {
        "run_id": "pool-down",
        "system": "game",
        "agents": {"p": {"url": "self"}, "past": {"url": refusing_url, "trainable": False}},
        "game": {"name": "nim", "seats": ["p", "pool"], "opponents": opponents},
        "engine": {**ENGINE, "peer_deadline_s": 600, "abort_retry_wait_s": 0.05, "connect_timeout_s": 2},
    }
    prompts = "Nim: 7 stones"

    async def go():
        args = slime_args(me.url, str(tiny_model_dir), mrlx, rollout_max_response_len=256)
        try:
            first = await asyncio.gather(
                *(generate(args, s, params(args)) for s in samples_of(6, 2, prompts, ""))
            )
            # a later step: the member is still marked down, its episodes end without a call
            later = [await generate(args, s, params(args)) for s in group(6, 2, prompts, "")]
            later += [await generate(args, s, params(args)) for s in group(10, 2, prompts, "")]
        finally:
            await (await get_runtime(args)).aclose()
        return first, later

    first, later = asyncio.run(go())

    def drawn(outs: list[list]) -> list[str]:
        return [pool_draw(f"{mrlx['run_id']}:group{out[0].group_index}", opponents, 1) for out in outs]

    for outs in (first, later):
        assert "past" in drawn(outs) and "script:random" in drawn(outs), drawn(outs)
        for who, out in zip(drawn(outs), outs):
            meta = out[0].metadata["mrlx"]
            if who == "past":
                assert out[0].status == Status.ABORTED and meta["episode"]["opponent_down"] == "past"
                assert "opponent-pool member 'past'" in meta["abort_reason"], meta["abort_reason"]
                assert refusing_url in meta["abort_reason"]
            else:
                assert not meta["aborted"] and "opponent_down" not in meta["episode"]
        down = drawn(outs).count("past")
        assert compute_metrics([s for out in outs for s in out])["multi_agent/opponent_down"] == down
    for who, out in zip(drawn(later), later):
        if who == "past":  # marked down by the first step: no engine call was made
            assert out[0].metadata["mrlx"]["aborted_turns"] == 0, out[0].metadata["mrlx"]["abort_reason"]
    logged = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "opponent-pool member 'past'" in logged and refusing_url in logged
