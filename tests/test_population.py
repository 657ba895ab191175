"""Self-play against a population of the agent's own past policies (`mrlx.game.population`): the
draw (per prompt group, reproducible, the learner in every seat over many groups, only snapshots
that exist at the episode's weight version, `latest` respected); a snapshot seat's requests go to
its adapter `ADAPTER@VERSION` and its transcript trains nothing, the fan-out unchanged (stub
engines over real sockets); the embedded trainer loads the snapshots on the embedded engine as it
pushes the weights, unloads those no longer drawn, and a resumed trainer loads them again; and
the refusals."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from _host import engine_stats, generate_all, params, slime_args

from mrlx_plugin.core.config import ConfigError, parse_settings
from mrlx_plugin.core.host import Sample, Status
from mrlx_plugin.core.metrics import compute_metrics
from mrlx_plugin.rollout import generate
from mrlx_plugin.runtime import get_runtime
from mrlx_plugin.settings import job_sections
from mrlx_plugin.systems.game import GAME
from mrlx_plugin.systems.game_pool import (
    WEIGHT_VERSION_ARG,
    PopulationSettings,
    population_draw,
    snapshot_versions,
)

REPO = Path(__file__).resolve().parent.parent
ENGINE = {"max_retries": 0, "request_timeout_s": 30}


# --- the draw -------------------------------------------------------------------------------------


def test_snapshot_versions_are_the_last_keep_multiples_of_every_up_to_the_version():
    assert snapshot_versions(0, 1, 4) == [0]
    assert snapshot_versions(3, 1, 4) == [0, 1, 2, 3]
    assert snapshot_versions(7, 1, 3) == [5, 6, 7]
    assert snapshot_versions(9, 4, 2) == [4, 8]
    assert snapshot_versions(3, 4, 2) == [0]


def test_the_draw_is_per_group_reproducible_and_puts_the_learner_in_every_seat():
    pop = PopulationSettings(every=2, keep=3, latest=0.3)
    players = ["p", "p"]
    learners, latest, versions = Counter(), 0, Counter()
    groups = 2000
    for g in range(groups):
        key, version = f"run:group{g}", g % 11
        drawn, learner = population_draw(key, players, "p", version, pop)
        assert (drawn, learner) == population_draw(key, players, "p", version, pop)  # reproducible
        assert learner in (0, 1) and drawn[learner] == "p"
        learners[learner] += 1
        other = drawn[1 - learner]
        if other == "p":
            latest += 1
        else:
            agent, _, v = other.partition("@")
            assert agent == "p" and int(v) in snapshot_versions(version, 2, 3)  # exists, and is kept
            assert int(v) <= version and int(v) % 2 == 0
            versions[int(v)] += 1
    assert abs(learners[0] / groups - 0.5) < 0.05  # both seats learn
    assert abs(latest / groups - 0.3) < 0.05  # `latest` respected
    assert set(versions) == {0, 2, 4, 6, 8, 10}  # every kept snapshot is drawn some time
    # Other keys draw otherwise; a seat no agent of the population plays is left as it is.
    assert len({tuple(population_draw(f"k{i}", players, "p", 9, pop)[0]) for i in range(50)}) > 2
    assert population_draw("k", ["script:random", "p"], "p", 4, pop) == (["script:random", "p"], 1)
    assert population_draw("k", ["q", "r"], "p", 4, pop) == (["q", "r"], None)


def test_latest_one_is_plain_self_play_and_latest_zero_always_a_snapshot():
    for g in range(200):
        assert population_draw(f"g{g}", ["p", "p"], "p", 5, PopulationSettings(latest=1.0))[0] == ["p", "p"]
        drawn, learner = population_draw(f"g{g}", ["p", "p"], "p", 5, PopulationSettings(latest=0.0))
        assert drawn[learner] == "p" and drawn[1 - learner].startswith("p@")
    # no weight version known: no snapshot at all
    assert population_draw("g", ["p", "p"], "p", None, PopulationSettings(latest=0.0))[0] == ["p", "p"]


# --- episodes over stub engines -------------------------------------------------------------------


def population_mrlx(population: dict, credit: str = "episode", **agent: Any) -> dict:
    return {
        "run_id": "population",
        "system": "game",
        "agents": {"p": {"url": "self", "adapter": "p-lora", **agent}},
        "game": {"name": "nim", "seats": ["p", "p"], "population": {"agent": "p", **population}},
        "rewards": {"credit": credit},
        "engine": ENGINE,
    }


def run_groups(url: str, tokenizer: Path, mrlx: dict, version: int | None, groups: int, per_group: int):
    """One generate call per episode, `per_group` episodes in each of `groups` prompt groups, as
    the embedded trainer's rollout at weight `version` runs them (None: a host that does not say);
    each call's samples."""

    args = slime_args(url, str(tokenizer), mrlx, rollout_max_response_len=1024)
    if version is not None:
        setattr(args, WEIGHT_VERSION_ARG, version)
    samples = [
        Sample(
            group_index=g,
            index=g * per_group + j,
            prompt=f"Nim: {4 + g % 3} stones",
            label=None,
            rollout_id=g * per_group + j,  # a generate call's id, not the step
        )
        for g in range(groups)
        for j in range(per_group)
    ]
    return generate_all(args, samples)


@pytest.fixture
def lora_stub(stubs_with):
    """A stub engine answering every move \\boxed{1}, serving `p-lora` and the snapshots named."""
    return lambda *names: stubs_with(
        "--text", "\\boxed{1}", "--response-tokens", "12", "--lora-names", "p-lora", *names
    )


@pytest.mark.parametrize("credit", ["episode", "turn"])
def test_a_snapshot_seat_plays_its_adapter_and_trains_nothing(credit, lora_stub, tiny_model_dir):
    # Weight version 5, snapshots every 2 kept 2: only p-lora@2 and p-lora@4 may be drawn; the
    # stub serves those and refuses any other name (the episode would end ABORTED).
    stub = lora_stub("p-lora@2", "p-lora@4")
    mrlx = population_mrlx({"every": 2, "keep": 2, "latest": 0.0}, credit)
    groups, per_group = 8, 2
    outs = run_groups(stub.url, tiny_model_dir, mrlx, 5, groups, per_group)
    stones = {g: 4 + g % 3 for g in range(groups)}
    expected_paths: Counter = Counter()
    learners = set()
    for g in range(groups):
        lineups = set()
        for out in outs[g * per_group : (g + 1) * per_group]:
            facts = out[0].metadata["mrlx"]["episode"]
            assert facts["learner"] in ("first", "second") and not any(
                s.metadata["mrlx"]["aborted"] for s in out
            )
            players = facts["players"]
            lineups.add((tuple(players), facts["learner"]))
            seat = ("first", "second").index(facts["learner"])
            assert players[seat] == "p" and players[1 - seat] in ("p@2", "p@4")
            assert facts["first_seat"] == facts["learner"] and facts["opponent"] == players[1 - seat]
            learners.add(facts["learner"])
            by_role: dict[str, list] = {}
            for s in out:
                by_role.setdefault(s.metadata["mrlx"]["role"], []).append(s)
            learner, snapshot = by_role[facts["learner"]], by_role[("first", "second")[1 - seat]]
            # the learner's moves are trained; the snapshot's sample holds its moves, none trained
            assert sum(sum(s.loss_mask) for s in learner) > 0
            assert all(sum(s.loss_mask) == 0 for s in snapshot)
            assert [s.status for s in snapshot if s.status != Status.ABORTED] == [Status.COMPLETED]
            assert snapshot[0].response_length > 1 and "boxed" in snapshot[0].response
            moves = facts["moves"]
            expected_paths["p-lora"] += (moves + 1) // 2 if seat == 0 else moves // 2
            expected_paths[f"p-lora@{players[1 - seat][2:]}"] += moves // 2 if seat == 0 else (moves + 1) // 2
            assert moves == stones[g]
        assert len(lineups) == 1  # one prompt group, one draw: its episodes compare like with like
    # the fan-out is the system's, whoever plays the seats: 2 seats (x turns, under per-turn credit)
    settings = parse_settings(mrlx, sections=job_sections())
    per_seat = 1 if credit == "episode" else GAME.turns(settings)["p"]
    assert {len(out) for out in outs} == {GAME.fan_out(settings)["p"] * per_seat}
    assert credit == "episode" or per_seat >= 3  # per-turn: fillers for the snapshot's turns
    assert learners == {"first", "second"}  # both seats learn over the groups
    # every request of a snapshot seat named its adapter; the learner's the agent's own
    assert engine_stats(stub.url)["lora_paths"] == dict(expected_paths)
    metrics = compute_metrics([s for out in outs for s in out])
    assert {k for k in metrics if k.startswith("game/win_rate/vs/")} <= {
        "game/win_rate/vs/p@2",
        "game/win_rate/vs/p@4",
    }
    assert any(k.startswith("game/win_rate/vs/p@") for k in metrics)


def test_evaluation_plays_the_latest_policy_in_every_seat(lora_stub, tiny_model_dir):
    stub = lora_stub()
    mrlx = population_mrlx({"latest": 0.0})

    async def run():
        args = slime_args(stub.url, str(tiny_model_dir), mrlx, rollout_max_response_len=1024)
        s = Sample(group_index=0, index=0, prompt="Nim: 3 stones", label=None, rollout_id=4)
        try:
            return await generate(args, s, params(args), evaluation=True)
        finally:
            await (await get_runtime(args)).aclose()

    out = asyncio.run(run())
    out = out if isinstance(out, list) else [out]
    assert out[0].metadata["mrlx"]["episode"]["players"] == ["p", "p"]
    assert engine_stats(stub.url)["lora_paths"] == {"p-lora": 3}


def test_a_host_that_does_not_say_its_weight_version_is_refused(lora_stub, tiny_model_dir):
    stub = lora_stub()
    with pytest.raises(ConfigError, match=f"mrlx.game.population: .*args.{WEIGHT_VERSION_ARG}"):
        run_groups(stub.url, tiny_model_dir, population_mrlx({}), None, 1, 1)
    assert engine_stats(stub.url)["lora_paths"] == {}  # refused before any move


# --- refusals -------------------------------------------------------------------------------------


def settings_with(population: dict, seats=("p", "p"), **agent: Any):
    data = {
        "system": "game",
        "agents": {"p": {"url": "self", "adapter": "p-lora", **agent}, "q": {"url": "self"}},
        "game": {"name": "nim", "seats": list(seats), "population": population},
    }
    return parse_settings(data, sections=job_sections())


@pytest.mark.parametrize(
    ("population", "seats", "agent", "message"),
    [
        ({"agent": "p"}, ("p", "p"), {"adapter": None}, "is not served as a LoRA adapter"),
        ({"agent": "p"}, ("p", "p"), {"trainable": False}, "is not trainable"),
        ({"agent": "p"}, ("q", "q"), {}, "plays no seat"),
        ({"agent": "nobody"}, ("p", "p"), {}, "is not an agent"),
        ({}, ("p", "p"), {}, "name the agent"),
        ({"agent": "p", "every": 0}, ("p", "p"), {}, "every"),
        ({"agent": "p", "latest": 1.5}, ("p", "p"), {}, "latest"),
        ({"agent": "p", "keep": 0}, ("p", "p"), {}, "keep"),
    ],
)
def test_a_population_that_cannot_be_is_refused(population, seats, agent, message):
    with pytest.raises(ConfigError) as refused:
        settings_with(population, seats, **agent)
    assert "mrlx.game.population" in str(refused.value) and message in str(refused.value)


def test_a_population_is_accepted_with_its_agent_by_name_or_as_self():
    assert settings_with({"agent": "p"}).game.population.agent == "p"
    data = {
        "system": "game",
        "self": "p",
        "agents": {"p": {"url": "self", "adapter": "p-lora"}},
        "game": {"name": "nim", "seats": ["p", "p"], "population": {"every": 3}},
    }
    assert parse_settings(data, sections=job_sections()).game.population.every == 3


def test_the_trainer_takes_snapshots_only_of_the_adapter_it_trains():
    from mrlx_plugin.local.trainer.weights import population_of

    def job(self_agent: str) -> Any:
        data = {
            "system": "game",
            "self": self_agent,
            "agents": {"p": {"url": "self", "adapter": "p-lora"}, "q": {"url": "http://127.0.0.1:9"}},
            "game": {"name": "nim", "seats": ["p", "q"], "population": {"agent": "p"}},
        }
        return parse_settings(data, sections=job_sections())

    assert population_of(job("p"), "p-lora").agent == "p"
    with pytest.raises(ConfigError, match="mrlx.game.population.agent is 'p', but this trainer trains"):
        population_of(job("q"), None)


# --- the embedded trainer and engine ----------------------------------------------------------------


def served_snapshots(url: str) -> dict[str, dict]:
    with urllib.request.urlopen(url + "/server_info", timeout=10) as resp:
        adapters = json.loads(resp.read())["lora_adapters"]
    return {name: a for name, a in adapters.items() if "@" in name}


def test_the_trainer_loads_each_snapshot_unloads_old_ones_and_a_resume_loads_them_again(
    tiny_model_dir, logs_dir, tmp_path
):
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from mrlx_plugin.local.model import ensure_adapter
    from mrlx_plugin.local.services import start_engine

    adapter = ensure_adapter(tmp_path / "p-lora", tiny_model_dir, rank=4, alpha=8, seed=1)
    config = tmp_path / "job.yaml"
    agent = {"url": "self", "adapter": "p-lora", "tokenizer": str(tiny_model_dir)}
    config.write_text(
        yaml.safe_dump(
            {
                "mrlx": {
                    "run_id": "population-trainer",
                    "system": "game",
                    "self": "p",
                    "agents": {"p": {**agent, "sampling": {"max_new_tokens": 6}}},
                    "game": {
                        "name": "nim",
                        "seats": ["p", "p"],
                        "population": {"every": 1, "keep": 4, "latest": 0.0},
                    },
                    "engine": ENGINE,
                    "trainer": {"threads": 1, "micro_batch_size": 8},
                }
            }
        )
    )
    out = tmp_path / "trainer"

    def train(engine_url: str, steps: int, *more: str) -> None:
        argv = [
            *("--config", str(config), "--model", str(tiny_model_dir), "--adapter", str(adapter)),
            *("--engine-url", engine_url, "--router-url", engine_url, "--out", str(out)),
            *("--prompt-data", str(REPO / "examples" / "games" / "nim_prompts.jsonl")),
            *("--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", str(steps)),
            "--save-samples",
            *more,
        ]
        proc = subprocess.run(
            [sys.executable, "-m", "mrlx_plugin.local.trainer", *argv],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]

    def engine(name: str):
        return start_engine(
            tiny_model_dir,
            log_dir=logs_dir,
            name=name,
            threads=1,
            extra=["--lora-paths", f"p-lora={adapter}"],
        )

    first = engine("engine-population")
    try:
        train(first.url, 3)
        served = served_snapshots(first.url)
    finally:
        first.stop()
    # 3 steps: weight versions 0 (the start), 1, 2, 3, each a snapshot, each served as it was pushed
    assert {n: a["weight_version"] for n, a in served.items()} == {f"p-lora@{v}": str(v) for v in range(4)}
    assert {n: a["lora_path"] for n, a in served.items()} == {
        f"p-lora@{v}": str(out / "snapshots" / f"v{v}") for v in range(4)
    }
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for row in rows:  # every episode met a snapshot of its step (latest: 0), none refused
        facts = row["metadata"]["mrlx"]["episode"]
        assert not row["metadata"]["mrlx"]["aborted"], row["metadata"]["mrlx"]["abort_reason"]
        other = [who for who in facts["players"] if who != "p"]
        assert len(other) == 1 and 0 <= int(other[0].split("@")[1]) <= row["step"]
    # nim's first seat moves first: where the learner sat second, the snapshot's adapter was called
    assert any(r["metadata"]["mrlx"]["episode"]["learner"] == "second" for r in rows)

    # A fresh engine, only the adapter: the resumed trainer loads the kept snapshots before its
    # first rollout, then takes version 4 and drops version 0 (keep: 4).
    second = engine("engine-population-resumed")
    try:
        train(second.url, 4, "--resume")
        served = served_snapshots(second.url)
    finally:
        second.stop()
    assert {n: a["weight_version"] for n, a in served.items()} == {f"p-lora@{v}": str(v) for v in range(1, 5)}
    assert sorted(p.name for p in (out / "snapshots").iterdir()) == ["v1", "v2", "v3", "v4"]
    resumed = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {r["step"] for r in resumed} == {0, 1, 2, 3}
    assert not any(r["metadata"]["mrlx"]["aborted"] for r in resumed if r["step"] == 3)
