"""The hooks' contracts: first-result hooks asked one plugin at a time (an awaited None defers),
shaping that returns the rewards it decides, systems collected through the plugin manager, and
one owner for each thing a rollout process keeps.

End to end through `generate` against the stub engine (it answers "\\boxed{42}" and
"Judgment: 1"; the label is 42), with hook modules written as a user would write them.
"""

from __future__ import annotations

import asyncio

import pluggy
import pytest
from _hookmodule import write_hook_module
from _host import group, params, slime_args

from mrlx_plugin import hookspecs
from mrlx_plugin.core.config import ConfigError
from mrlx_plugin.episodes import HookResultError
from mrlx_plugin.hookspecs import hookimpl
from mrlx_plugin.link.outbox import PeerOutbox
from mrlx_plugin.plugins import collect_systems, make_plugin_manager, resolve_first
from mrlx_plugin.rewards.shaping import math_verifier
from mrlx_plugin.rollout import generate
from mrlx_plugin.runtime import get_runtime, runtime_for


def _mrlx(**overrides):
    mrlx = {
        "run_id": "hooks",
        "system": "pipeline",
        "pipeline": {"num_parallel": 2, "weighting": "none"},
        "engine": {"max_retries": 1, "request_timeout_s": 5},
    }
    mrlx.update(overrides)
    return mrlx


def _episode(stub, tiny_model_dir, **mrlx):
    async def run():
        args = slime_args(stub.url, str(tiny_model_dir), _mrlx(**mrlx))
        try:
            return await generate(args, group(0, 1)[0], params(args))
        finally:
            await (await get_runtime(args)).aclose()

    return asyncio.run(run())


def _rewards(out) -> dict[str, float]:
    return {s.metadata["mrlx"]["label"]: s.reward for s in out}


# --- mrlx_grade: an awaited None defers ---------------------------------------------------------

GRADERS = {
    # an async implementation that defers for everyone: the default grades (\boxed{42} vs 42: 1.0)
    "async_defers": "@hookimpl\nasync def mrlx_grade(agent, transcript, episode):\n    return None\n",
    # an async implementation that answers for the solvers and defers for the others
    "async_answers": "@hookimpl\nasync def mrlx_grade(agent, transcript, episode):\n"
    "    await asyncio.sleep(0)\n    return 0.25 if agent == 'solver' else None\n",
    # a sync implementation that returns an awaitable (of a number, or of None: defer)
    "sync_awaitable": "async def _later(value):\n    await asyncio.sleep(0)\n    return value\n\n"
    "@hookimpl\ndef mrlx_grade(agent, transcript, episode):\n"
    "    return _later(0.25 if agent == 'solver' else None)\n",
}


@pytest.mark.parametrize("kind", sorted(GRADERS))
def test_an_awaited_none_defers_to_the_next_grader(kind, stub_engine, tiny_model_dir, tmp_path, monkeypatch):
    module = write_hook_module(tmp_path, monkeypatch, f"grade_{kind}", GRADERS[kind])
    rewards = _rewards(_episode(stub_engine, tiny_model_dir, plugins=[module]))
    solver = 1.0 if kind == "async_defers" else 0.25
    assert rewards["solver-0"] == rewards["solver-1"] == solver
    assert rewards["rewriter-0"] == rewards["rewriter-1"] == 1.0  # deferred: the default's grade


def test_a_deferring_async_grader_hands_over_to_the_next_plugin(
    stub_engine, tiny_model_dir, tmp_path, monkeypatch
):
    # pluggy asks the plugin registered last first: `late_defers`, then `early_half`, then the default
    early = write_hook_module(
        tmp_path, monkeypatch, "early_half", "@hookimpl\ndef mrlx_grade(agent):\n    return 0.5\n"
    )
    late = write_hook_module(
        tmp_path, monkeypatch, "late_defers", "@hookimpl\nasync def mrlx_grade(agent):\n    return None\n"
    )
    rewards = _rewards(_episode(stub_engine, tiny_model_dir, plugins=[early, late]))
    assert set(rewards.values()) == {0.5}  # the selector earns the grade of the rewrite it picked


class _Recorder:
    """A plugin object for the call-order test (each instance one plugin)."""

    def __init__(self, name, value, calls, is_async, **opts):
        self.name, self.value, self.calls = name, value, calls

        def sync(agent, transcript, episode):
            self.calls.append(self.name)
            return self.value

        async def asynchronous(agent, transcript, episode):
            self.calls.append(self.name)
            return self.value

        self.mrlx_grade = hookimpl(**opts)(asynchronous if is_async else sync)


def test_plugins_are_asked_once_each_in_pluggys_call_order():
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    calls: list[str] = []
    pm.register(_Recorder("last", 9.0, calls, False, trylast=True), name="last")
    pm.register(_Recorder("answers", 0.75, calls, True), name="answers")
    pm.register(_Recorder("sync_none", None, calls, False), name="sync_none")
    pm.register(_Recorder("first", None, calls, True, tryfirst=True), name="first")
    hook = resolve_first(pm, "mrlx_grade")  # resolved once, as when the plugins load
    assert [name for name, _ in hook.callers] == ["first", "sync_none", "answers", "last"]
    result = hook.ask(agent="a", transcript=None, episode=None)
    assert asyncio.run(result) == ("answers", 0.75)
    assert calls == ["first", "sync_none", "answers"]  # the trylast one is never asked
    calls.clear()
    pm.unregister(name="answers")
    plain = resolve_first(pm, "mrlx_grade")  # resolved again with the plugins now registered
    assert asyncio.run(plain.ask(agent="a", transcript=None, episode=None)) == ("last", 9.0)
    assert calls == ["first", "sync_none", "last"]


# --- mrlx_shape_rewards: the rewards it decides, checked and applied by the episode ----------------


def test_shaping_returns_rewards_by_transcript_position(stub_engine, tiny_model_dir, tmp_path, monkeypatch):
    module = write_hook_module(
        tmp_path,
        monkeypatch,
        "shape_by_position",
        (
            "@hookimpl\ndef mrlx_shape_rewards(episode, team_shaping):\n"
            "    episode.metadata['team_shaping_seen'] = team_shaping\n"
            "    return {i: 10.0 + i for i, t in enumerate(episode.transcripts) if t.raw_reward is not "
            "None}\n"
        ),
    )
    out = _episode(stub_engine, tiny_model_dir, plugins=[module])
    # the pipeline opens solver-0, solver-1, rewriter-0, rewriter-1, selector in that order
    assert _rewards(out) == {
        "solver-0": 10.0,
        "solver-1": 11.0,
        "rewriter-0": 12.0,
        "rewriter-1": 13.0,
        "selector": 14.0,
    }
    assert all(s.metadata["mrlx"]["raw_reward"] == 1.0 for s in out)  # raw rewards untouched
    assert out[0].metadata["mrlx"]["episode"]["team_shaping_seen"] is True  # the pipeline declares it


def test_a_deferring_shaper_leaves_the_default(stub_engine, tiny_model_dir, tmp_path, monkeypatch):
    module = write_hook_module(
        tmp_path,
        monkeypatch,
        "shape_defers",
        "@hookimpl\ndef mrlx_shape_rewards(episode, settings):\n    return None\n",
    )
    out = _episode(
        stub_engine, tiny_model_dir, plugins=[module], pipeline={"num_parallel": 2, "weighting": "offset"}
    )
    assert list(_rewards(out).values()) == [pytest.approx(1.2)] * 5  # the default's team weighting


BAD_SHAPES = {
    "the old contract": ("True", "returned True (bool)"),
    "a missing position": ("{0: 1.0}", "no reward for graded transcript(s) 1 (solver-1)"),
    "an extra position": (
        "{**{i: 1.0 for i in range(5)}, 7: 1.0}",
        "positions [7] are not graded transcripts",
    ),
    # (a NaN alone ends its episode only: tests/faults/test_nonfinite_rewards.py)
    "a NaN and a string": (
        "{i: (math.nan if i == 2 else '1.0') for i in range(5)}",
        "not finite numbers: 0: '1.0'",
    ),
    "a string": ("{i: '1.0' for i in range(5)}", "not finite numbers: 0: '1.0'"),
    "labels as keys": (
        "{t.label: 1.0 for t in episode.transcripts}",
        "keys that are not positions: 'rewriter-0', ",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_SHAPES))
def test_a_wrong_shaping_answer_is_one_error_naming_the_plugin(
    case, stub_engine, tiny_model_dir, tmp_path, monkeypatch
):
    body, message = BAD_SHAPES[case]
    name = "bad_shape_" + case.replace(" ", "_")
    module = write_hook_module(
        tmp_path, monkeypatch, name, f"@hookimpl\ndef mrlx_shape_rewards(episode):\n    return {body}\n"
    )
    with pytest.raises(HookResultError) as info:
        _episode(stub_engine, tiny_model_dir, plugins=[module])
    text = str(info.value)
    assert f"mrlx_shape_rewards of plugin '{name}'" in text and message in text, text


# --- mrlx_register_systems: through the plugin manager ---------------------------------------------


def test_a_system_registered_twice_names_both_plugins(tmp_path, monkeypatch):
    quiet = write_hook_module(
        tmp_path, monkeypatch, "systems_none", "@hookimpl\ndef mrlx_register_systems():\n    return None\n"
    )
    extra = write_hook_module(
        tmp_path,
        monkeypatch,
        "systems_extra",
        (
            "from mrlx_plugin import System\n\n"
            "async def solo(episode):\n    pass\n\n"
            "@hookimpl\ndef mrlx_register_systems():\n    return {'solo': System(run=solo)}\n"
        ),
    )
    assert set(collect_systems(make_plugin_manager([quiet, extra]))) == {
        "pipeline",
        "dialogue",
        "game",
        "debate",
        "solo",
    }
    twice = write_hook_module(
        tmp_path,
        monkeypatch,
        "systems_twice",
        (
            "from mrlx_plugin import System\n\n"
            "async def other(episode):\n    pass\n\n"
            "@hookimpl\ndef mrlx_register_systems():\n    return {'pipeline': System(run=other)}\n"
        ),
    )
    with pytest.raises(
        ConfigError, match="'pipeline' is registered twice: by mrlx_plugin.defaults and by systems_twice"
    ):
        collect_systems(make_plugin_manager([quiet, twice]))


# --- one owner per thing a process keeps ---------------------------------------------------------


def test_one_runtime_per_args_sharing_tokenizers_and_the_reward_functions_verifier(tiny_model_dir):
    args = slime_args("http://127.0.0.1:9", str(tiny_model_dir), _mrlx())
    other = slime_args("http://127.0.0.1:9", str(tiny_model_dir), _mrlx())
    runtime = runtime_for(args)
    assert runtime_for(args) is runtime and asyncio.run(get_runtime(args)) is runtime
    assert runtime_for(other) is not runtime
    # the agents of one model share one tokenizer (and its prompt caches)
    assert runtime.tokenizers["solver"] is runtime.tokenizers["rewriter"] is runtime.tokenizers["selector"]
    # `reward(args, ...)` gets nothing but args: it finds the same worker as the Runtime's grader
    assert math_verifier(args) is runtime.verifier and math_verifier(other) is runtime_for(other).verifier
    assert runtime.verifier is not runtime_for(other).verifier
    assert runtime.system.team_shaping is True and runtime.trained_samples_per_episode() == 5


def test_peer_samples_need_an_open_step(tiny_model_dir):
    args = slime_args("http://127.0.0.1:9", str(tiny_model_dir), _mrlx())
    settings = runtime_for(args).settings
    outbox = PeerOutbox(settings, "job.yaml", ["b"])
    with pytest.raises(
        ConfigError,
        match="job.yaml: .* samples for b.*--rollout-function-path mrlx_plugin.rollout.initiator_rollout",
    ):
        outbox.add(0, "e0", {"b": []})
    outbox.open_step(3)
    outbox.add(0, "e0", {"b": []})
    assert outbox.step == 3 and outbox.groups[0].episodes == 1


def test_the_outbox_observes_the_training_episodes_of_a_job_with_peers(tiny_model_dir, monkeypatch):
    """A job whose episodes have samples for another job's agent registers its outbox on the
    mrlx_episode_end hook: a training episode's samples for that agent go to it, an evaluation
    episode's do not. A job without peer agents registers none."""
    from types import SimpleNamespace

    from _twojobs import two_job_config

    import mrlx_plugin.runtime

    nowhere = "http://127.0.0.1:9"
    mrlx = two_job_config("a", run_id="observe", urls={"b": nowhere}, coordinator=nowhere)
    args = slime_args(
        nowhere, str(tiny_model_dir), mrlx, rollout_function_path="mrlx_plugin.rollout.initiator_rollout"
    )
    runtime = runtime_for(args)
    outbox = runtime.outbox
    assert outbox is not None and outbox.peer_agents == ["b"]

    def ended(evaluation: bool, episode_id: str):
        return SimpleNamespace(evaluation=evaluation, sample=SimpleNamespace(group_index=7), id=episode_id)

    # the samples the observer builds of an episode (episodes.samples.samples_of)
    monkeypatch.setattr(
        mrlx_plugin.runtime,
        "samples_of",
        lambda episode, agents, every_agent: [f"{agents[0]}-sample" for _ in range(2)],
    )

    outbox.open_step(0)
    runtime.pm.hook.mrlx_episode_end(episode=ended(True, "eval"), samples=[])
    assert outbox.groups == {}
    runtime.pm.hook.mrlx_episode_end(episode=ended(False, "e1"), samples=[])
    assert outbox.groups[7].episodes == 1
    assert outbox.groups[7].samples == {"b": [("e1:b:0", "b-sample"), ("e1:b:1", "b-sample")]}

    shared = runtime_for(slime_args(nowhere, str(tiny_model_dir), _mrlx()))
    assert shared.outbox is None and shared.pm.get_plugin("mrlx_plugin.link.outbox") is None


def test_a_hook_under_another_name_is_refused_at_start_up(tiny_model_dir, tmp_path, monkeypatch):
    # each plugin is asked alone through pm.subset_hook_caller, which leaves plugins out by the
    # hook's attribute name: a `specname` implementation could not be left out
    module = write_hook_module(
        tmp_path,
        monkeypatch,
        "grade_by_specname",
        "@hookimpl(specname='mrlx_grade')\ndef my_grade(agent):\n    return 0.5\n",
    )
    args = slime_args("http://127.0.0.1:9", str(tiny_model_dir), _mrlx(plugins=[module]))
    with pytest.raises(
        ConfigError,
        match="grade_by_specname: implements mrlx_grade as 'my_grade' .* name the function mrlx_grade",
    ):
        runtime_for(args)
