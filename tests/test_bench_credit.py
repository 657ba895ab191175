"""`mrlx bench credit --quick --seeds 2`: every arm of every part runs for real (embedded engines,
the embedded trainer, the game system through the plugin's rollout functions) until its engine-call
budget is spent, is evaluated and probed, and the report has its full structure and invariants.
Learning and timings are the benchmark's to report, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _procs import processes_naming

from mrlx_lab.bench.credit.probes import kuhn_average
from mrlx_plugin.systems.library_games import kuhn_exploitability

pytestmark = pytest.mark.slow  # 2 seeds x (a warm-start and 11 short arms), 2 at a time (about 200 s)

REPO = Path(__file__).resolve().parent.parent
SEEDS, BUDGET, NIM_BUDGET, KUHN_BUDGET = 2, 24, 40, 32
CHAIN_ARMS = ["episode", "turn", "tree", "tree-random", "tree-old"]
NIM_ARMS, KUHN_ARMS = ["nim", "nim-mean", "nim-tree"], ["kuhn", "kuhn-mean", "kuhn-entropy"]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mrlx_plugin.cli", "bench", "credit", *args],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_quick_run_spends_equal_calls_per_arm_and_reports_over_the_seeds(tmp_path: Path):
    out = tmp_path / "bench"
    proc = bench("--quick", "--quiet", "--seeds", str(SEEDS), "--out", str(out), "--arms", "all")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "credit.json").read_text())
    assert set(r) >= {"machine", "config", "seeds", "chain", "nim", "kuhn", "wall_time_s", "plot"}
    assert r["seeds"] == [0, 1] and r["config"]["quick"] is True
    assert [w["seed"] for w in r["warm_start"]] == [0, 1]  # one format-only warm-start per seed
    budgets = {"chain": BUDGET, "nim": NIM_BUDGET, "kuhn": KUHN_BUDGET}
    arms = {"chain": CHAIN_ARMS, "nim": NIM_ARMS, "kuhn": KUHN_ARMS}

    for part, names in arms.items():
        assert list(r[part]["arms"]) == names, part
        for name in names:
            arm = r[part]["arms"][name]
            runs = arm["runs"]
            assert [run["seed"] for run in runs] == [0, 1], (part, name)
            for run in runs:
                calls = run["engine_calls_per_step"]
                # The budget is spent, and overshot by less than the last step's calls.
                assert run["budget"] == budgets[part] and run["steps"] == len(calls) > 0
                assert run["engine_calls"] == sum(calls) >= budgets[part] > run["engine_calls"] - calls[-1]
                # Filler-free counts: never more than the samples returned; a trained one has a token.
                assert 0 < run["samples_trained"] <= run["samples_all"]
                assert run["tokens_trained"] >= run["samples_trained"]
            # Every measure's interval holds its mean; the values are the seeds'.
            for key, s in arm["summary"].items():
                assert s["low"] <= s["mean"] <= s["high"], (part, name, key)
                assert len(s["values"]) == SEEDS, (part, name, key)
        # The arms of a part spend the same calls within one step's worth, seed by seed.
        for seed in range(SEEDS):
            runs = [r[part]["arms"][n]["runs"][seed] for n in names]
            spent = [run["engine_calls"] for run in runs]
            widest = max(max(run["engine_calls_per_step"]) for run in runs)
            assert max(spent) - min(spent) <= widest, (part, seed)

    chain = r["chain"]
    rewards = {n: chain["arms"][n]["runs"][0]["rewards"] for n in CHAIN_ARMS}
    game = {n: chain["arms"][n]["runs"][0]["game"] for n in CHAIN_ARMS}
    assert rewards["episode"] == {"credit": "episode"} and rewards["turn"]["credit"] == "turn"
    assert (rewards["tree"]["branch_pick"], rewards["tree"]["branch_target"]) == ("best", "score")
    picks = {n: (rewards[n]["branch_pick"], rewards[n]["branch_target"]) for n in CHAIN_ARMS[2:]}
    assert picks["tree-random"] == ("random", "score") and picks["tree-old"] == ("best", "taken_return")
    assert game["tree"]["branch_score"] == "rollout" and game["tree-old"]["branch_score"] == "settle"
    for seed in range(SEEDS):
        runs = [chain["arms"][n]["runs"][seed] for n in CHAIN_ARMS]
        # evaluated before training (the same warm-start: the same evaluation) and after the last step
        assert len({json.dumps(run["before"], sort_keys=True) for run in runs}) == 1
        for run in runs:
            assert run["before"]["after_steps"] == 0 and run["after"]["after_steps"] == run["steps"]
            keys = ("success", "steps_right", "seen_success", "seen_steps_right")
            assert all(0.0 <= run["after"][k] <= 1.0 for k in keys)
        # The held-out chains: never trained on, and no training chain opens as one does.
        work = out / f"seed_{seed}" / "chain"
        train, held = lines(work / "prompts.jsonl"), lines(work / "heldout.jsonl")
        assert len(held) == r["config"]["eval_prompts"] == chain["units"][seed]["held_out_prompts"]
        first = {tuple(h["prompt"].split()[1:3]) for h in held}
        assert not first & {tuple(t["prompt"].split()[1:3]) for t in train}
        assert chain["units"][seed]["held_out_first_steps_in_training"] == 0

    nim = r["nim"]
    assert nim["reference"]["random_vs_random_trained"] == pytest.approx(0.5)
    assert nim["units"][0]["train_piles"] == [3, 4, 6, 8, 9] and nim["units"][0]["held_out_piles"] == [5, 7]
    for name in NIM_ARMS:
        for run in nim["arms"][name]["runs"]:
            for when in ("before", "after"):
                for opp in ("random", "optimal"):
                    for piles in ("trained", "held_out"):
                        for seat in ("first", "second"):
                            assert 0.0 <= run[when][f"{opp}_{piles}_{seat}"] <= 1.0
                probe = run[f"probe_{when}"]
                assert all(0.0 <= probe[k] <= 1.0 for k in ("optimal_trained", "optimal_held_out", "illegal"))
    assert nim["arms"]["nim-tree"]["runs"][0]["rewards"]["branch"] == r["config"]["branch"]
    # The -mean arms: mean-only advantages and a running baseline for lone turns; the controls not.
    for part, control, mean in (("nim", "nim", "nim-mean"), ("kuhn", "kuhn", "kuhn-mean")):
        c, m = r[part]["arms"][control]["runs"][0], r[part]["arms"][mean]["runs"][0]
        assert c["trainer"] == {} and "lone_baseline" not in c["rewards"]
        assert m["trainer"] == {"grpo_std_normalization": False}
        assert m["rewards"]["lone_baseline"] == "running"
    entropy = r["kuhn"]["arms"]["kuhn-entropy"]["runs"][0]["trainer"]
    assert entropy == {"grpo_std_normalization": False, "entropy_coef": r["config"]["entropy_coef"]}

    kuhn = r["kuhn"]
    # Uniform play's exploitability, computed through the helper the probes use.
    assert kuhn["reference"]["uniform_exploitability"] == pytest.approx(0.4583, abs=1e-3)
    for run in (run for name in KUHN_ARMS for run in kuhn["arms"][name]["runs"]):
        for when in ("before", "after"):
            probe = run[f"probe_{when}"]
            assert len(probe["policy"]) == 12 and 0.0 <= probe["illegal"] <= 1.0
            assert all(sum(p.values()) == pytest.approx(1.0) for p in probe["policy"].values())
            assert probe["exploitability"] >= 0.0
        # The snapshots: evenly spaced from the start to the last step, the ends the before and
        # after probes; the in-between ones loaded from checkpoints, which are then removed.
        spots = [snap["after_steps"] for snap in run["snapshots"]]
        assert spots[0] == 0 and spots[-1] == run["steps"] and spots == sorted(set(spots))
        assert len(spots) == min(r["config"]["snapshots"], run["steps"] + 1) and len(spots) >= 3
        assert run["snapshots"][0]["policy"] == run["probe_before"]["policy"]
        assert run["snapshots"][-1]["policy"] == run["probe_after"]["policy"]
        assert run["average"]["snapshots"] == spots
        assert run["average"]["exploitability"] == pytest.approx(
            kuhn_exploitability(kuhn_average([snap["policy"] for snap in run["snapshots"]]))
        )
        trainer_out = out / f"seed_{run['seed']}" / "kuhn" / run["arm"] / "trainer"
        assert not (trainer_out / "checkpoints").exists()

    # The docs' tables, from the saved JSON.
    table = bench("--table", str(out / "credit.json"))
    assert table.returncode == 0, table.stderr
    headings = (
        "| chain:",
        "| nim:",
        "| kuhn:",
        "held-out success, after RL",
        "exploitability, after RL (last iterate)",
        "exploitability of the average policy",
        "seeds whose average policy ends above the start",
    )
    for heading in headings:
        assert heading in table.stdout, heading
    assert table.stdout.strip() in proc.stdout
    if r["plot"] is not None:  # matplotlib installed
        assert Path(r["plot"]).read_bytes()[:4] == b"\x89PNG" and Path(r["plot"]).parent == out
    assert not processes_naming(str(tmp_path))


def test_the_average_policy_weights_each_snapshot_by_its_own_reach():
    from mrlx_lab.bench.credit.probes import kuhn_positions

    keys = [key for key, *_ in kuhn_positions()]

    def policy(open_check: float, call: float) -> dict[str, dict[str, float]]:
        out = {}
        for key, _seat, state, _ in kuhn_positions():
            if not state.history:
                out[key] = {"check": open_check, "bet": 1 - open_check}
            elif state.history[-1] == "bet":
                out[key] = {"call": call, "fold": 1 - call}
            else:
                out[key] = {"check": 0.5, "bet": 0.5}
        return out

    # Snapshot a never checks at the opening, so the first seat facing a bet after its check is
    # reached only by snapshot b: there the average is b's policy; elsewhere the plain mean.
    a, b = policy(open_check=0.0, call=1.0), policy(open_check=0.75, call=0.0)
    avg = kuhn_average([a, b])
    for key, seat, state, _ in kuhn_positions():
        if seat == 0 and state.history:
            assert avg[key] == pytest.approx(b[key]), key
        elif not state.history:
            assert avg[key] == pytest.approx({"check": 0.375, "bet": 0.625}), key
        else:
            assert avg[key] == pytest.approx({m: (a[key][m] + b[key][m]) / 2 for m in a[key]}), key
    # Reach 1/4 against 3/4: weights 1:3, not the plain 1:1.
    c = policy(open_check=0.25, call=1.0)
    facing = next(k for k in keys if k.startswith("first") and k.endswith("check bet"))
    assert kuhn_average([c, b])[facing]["call"] == pytest.approx(0.25)
    # One snapshot is its own average.
    assert kuhn_exploitability(kuhn_average([a])) == pytest.approx(kuhn_exploitability(a))


def test_options_that_cannot_run_are_refused_with_one_message(tmp_path: Path):
    for args, message in (
        (["--arms", "all", "--branch", "3"], "--samples-per-prompt 8: the tree arms run 3 times fewer"),
        (["--arms", "episode,nope"], "--arms: no arm 'nope'"),
        (["--seeds", "0"], "--seeds: got 0; expected at least 1"),
        (["--seed-start", "-1"], "--seed-start: got -1; expected at least 0"),
        (["--collect", "--only", "kuhn"], "--collect: no seed of"),
        (["--only", "nim", "--arms", "episode"], "no arm is left to run"),
    ):
        proc = bench("--out", str(tmp_path), *args)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr[-500:])
