"""The parts of one seed of `mrlx bench credit` (`UNITS`): the warm-start, the chain's arms, nim
by self-play and kuhn poker by self-play, each with its evaluation and probes."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from mrlx_lab.bench.credit.arms import job_config, run_arms, run_id_of, train_prompts, warm_model, warm_unit
from mrlx_lab.bench.credit.probes import kuhn_average, kuhn_positions, kuhn_probe, nim_probe, nim_reference
from mrlx_lab.bench.credit.settings import (
    AGENT,
    ILLEGAL_PENALTY,
    NIM_HELD_OUT,
    NIM_TAKE,
    NIM_TRAIN,
    OPPONENTS,
    SEATS,
)
from mrlx_lab.bench.credit.tasks import chain_sets, first_step, game_options, nim_prompt, write_prompts
from mrlx_plugin.core.values import JSONObject


def chain_unit(ns: argparse.Namespace, work: Path, base: Path) -> JSONObject:
    seed = ns.unit_seed
    train, held = chain_sets(ns, seed)
    prompts = write_prompts(work / "prompts.jsonl", train)
    held_out = write_prompts(work / "heldout.jsonl", held)
    # Beside the held-out chains, as many training chains: what was learnt where it was taught,
    # when the held-out chains (new first contexts) show little.
    seen = write_prompts(
        work / "trained-eval.jsonl", random.Random(seed).sample(train, min(len(train), len(held)))
    )
    game = {
        "name": "chain",
        "seats": [AGENT],
        "max_turns": ns.chain_length,
        "options": game_options("chain", train),
    }
    length = ns.chain_length

    def value(row: JSONObject) -> JSONObject:
        out: JSONObject = {}
        for name, prefix in (("held-out", ""), ("trained", "seen_")):
            success = row.get(f"eval/eval/{name}/game/win_rate/solver")
            turns = row.get(f"eval/eval/{name}/multi_agent/avg_turns")
            # An episode ends at its first wrong step: (turns - 1) right, or all of them.
            right = None if success is None or turns is None else (turns - 1 + success) / length
            out |= {f"{prefix}success": success, f"{prefix}steps_right": right}
        return out

    def show(row: JSONObject) -> str | None:
        if "eval/eval/held-out/episodes" not in row:
            return None
        v = {k: x or 0.0 for k, x in value(row).items()}
        return (
            f"after {row['step'] + 1:>3} steps: held-out success {v['success']:.3f}, steps right "
            f"{v['steps_right']:.3f} (trained chains {v['seen_success']:.3f}, {v['seen_steps_right']:.3f})"
        )

    eval_args = [
        "--eval-interval",
        str(ns.eval_interval),
        "--eval-prompt-data",
        *("held-out", str(held_out), "trained", str(seen)),
        "--n-samples-per-eval-prompt",
        str(ns.eval_samples or 2),
    ]
    arms = run_arms("chain", ns, work, game, prompts, eval_args, budget=ns.budget, show=show, value=value)
    first_held = sorted({first_step(p) for p, _ in held})
    return {
        "task": (
            f"chains of {length} steps (game `chain`): start 0 to {ns.chain_max_start}, steps "
            f"{' '.join(ns.chain_ops)} 1 to {ns.chain_max_step}; success = every step right"
        ),
        "train_prompts": len(train),
        "held_out_prompts": len(held),
        "held_out_first_steps": [f"{v} {op}" for v, op in first_held],
        "held_out_first_steps_in_training": sum(first_step(p) in first_held for p, _ in train),
        "arms": arms,
    }


def nim_unit(ns: argparse.Namespace, work: Path, base: Path) -> JSONObject:
    seed = ns.unit_seed
    train = train_prompts("nim", ns, seed)
    piles = {
        "trained": write_prompts(work / "trained.jsonl", [nim_prompt(p) for p in NIM_TRAIN]),
        "held-out": write_prompts(work / "held-out.jsonl", [nim_prompt(p) for p in NIM_HELD_OUT]),
    }
    prompts = write_prompts(work / "prompts.jsonl", train)
    game = {
        "name": "nim",
        "options": game_options("nim", train),
        "seats": [AGENT, AGENT],
        "illegal_penalty": ILLEGAL_PENALTY["nim"],
    }
    run_id, warm = run_id_of("nim", ns), warm_model(ns)
    # Evaluation: the trained model against each scripted player, in each seat order, on the
    # trained and the held-out starting piles.
    eval_args = [
        "--eval-interval",
        str(ns.eval_interval),
        "--n-samples-per-eval-prompt",
        str(ns.eval_samples or 8),
    ]
    for opp in OPPONENTS:
        for i, seat in enumerate(SEATS):
            seats = [AGENT, f"script:{opp}"] if i == 0 else [f"script:{opp}", AGENT]
            path = job_config(
                work / f"eval-{opp}-{seat}.yaml", run_id, warm, {**game, "seats": seats}, {}, ns, seed, "nim"
            )
            eval_args += ["--eval-config", f"{opp}-{seat}={path}"]
    eval_args += ["--eval-prompt-data", *(x for name, path in piles.items() for x in (name, str(path)))]

    def value(row: JSONObject) -> JSONObject:
        out: JSONObject = {}
        for opp in OPPONENTS:
            for pos in ("trained", "held-out"):
                key = f"{opp}_{pos.replace('-', '_')}"
                rates = [row.get(f"eval/{opp}-{s}/{pos}/game/win_rate/vs/script:{opp}") for s in SEATS]
                for s, r in zip(SEATS, rates):
                    out[f"{key}_{s}"] = r
                out[key] = None if None in rates else sum(rates) / len(rates)
                bad = [row.get(f"eval/{opp}-{s}/{pos}/game/illegal_rate") for s in SEATS]
                out[f"illegal_{key}"] = None if None in bad else sum(bad) / len(bad)
        return out

    def show(row: JSONObject) -> str | None:
        if "eval/random-first/trained/episodes" not in row:
            return None
        v = value(row)
        return (
            f"after {row['step'] + 1:>3} steps: win rate vs random {v['random_trained'] or 0:.3f} "
            f"(held-out piles {v['random_held_out'] or 0:.3f}), vs optimal {v['optimal_trained'] or 0:.3f}"
        )

    arms = run_arms(
        "nim",
        ns,
        work,
        game,
        prompts,
        eval_args,
        budget=ns.nim_budget,
        show=show,
        value=value,
        probe=nim_probe,
    )
    return {
        "task": f"nim, take 1 to {NIM_TAKE}, who takes the last stone wins; self-play",
        "train_piles": list(NIM_TRAIN),
        "held_out_piles": list(NIM_HELD_OUT),
        "reference": nim_reference(),
        "arms": arms,
    }


def kuhn_unit(ns: argparse.Namespace, work: Path, base: Path) -> JSONObject:
    seed = ns.unit_seed
    train = train_prompts("kuhn", ns, seed)
    prompts = write_prompts(work / "prompts.jsonl", train)
    game = {
        "name": "kuhn_poker",
        "seats": [AGENT, AGENT],
        "max_turns": 3,
        "illegal_penalty": ILLEGAL_PENALTY["kuhn"],
    }

    def shown(arm: str, run: JSONObject) -> None:  # no evaluation rows: the probes are the result
        from mrlx_plugin.systems.library_games import kuhn_exploitability

        # The average policy of the snapshots (evenly spaced in steps: weighted alike in time).
        policy = kuhn_average([snap["policy"] for snap in run["snapshots"]])
        run["average"] = {
            "exploitability": kuhn_exploitability(policy),
            "snapshots": [snap["after_steps"] for snap in run["snapshots"]],
            "policy": policy,
        }
        if not ns.quiet:
            before, after = run["probe_before"]["exploitability"], run["probe_after"]["exploitability"]
            print(
                f"  seed {seed} {arm:<17} exploitability {before:.3f} -> {after:.3f}, average policy "
                f"{run['average']['exploitability']:.3f}",
                flush=True,
            )

    arms = run_arms(
        "kuhn",
        ns,
        work,
        game,
        prompts,
        [],
        budget=ns.kuhn_budget,
        show=None,
        value=lambda r: {},
        probe=kuhn_probe,
        done=shown,
        snapshots=max(2, ns.snapshots),
    )
    return {
        "task": "Kuhn poker, self-play; exploitability of the probed policy (OpenSpiel)",
        "snapshots": max(2, ns.snapshots),
        "reference": {"uniform_exploitability": uniform_exploitability()},
        "arms": arms,
    }


def uniform_exploitability() -> float:
    """The exploitability of uniform play, through the same helper the probes use (0.458)."""
    from mrlx_plugin.systems.games import BUILT_IN_GAMES
    from mrlx_plugin.systems.library_games import kuhn_exploitability

    game = BUILT_IN_GAMES["kuhn_poker"]
    return kuhn_exploitability(
        {
            key: {m: 1 / len(game.legal_moves(state, seat)) for m in game.legal_moves(state, seat)}
            for key, seat, state, _ in kuhn_positions()
        }
    )


UNITS = {"warm": warm_unit, "chain": chain_unit, "nim": nim_unit, "kuhn": kuhn_unit}
