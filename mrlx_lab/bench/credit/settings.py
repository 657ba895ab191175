"""`mrlx bench credit`'s settings: the arms and parts, the fixed settings of every run, the
options (`build_parser`, with the defaults that depend on --quick filled in by `settle`), and
each arm's rewards and game settings (`arm_settings`)."""

from __future__ import annotations

import argparse

from mrlx_plugin.core.values import JSONObject

AGENT = "player"
PARTS = ("chain", "nim", "kuhn")
ARMS = {  # arm -> its part, in the order of the tables
    "episode": "chain",
    "turn": "chain",
    "tree": "chain",
    "tree-random": "chain",
    "tree-old": "chain",
    "nim": "nim",
    "nim-mean": "nim",
    "nim-tree": "nim",
    "kuhn": "kuhn",
    "kuhn-mean": "kuhn",
    "kuhn-entropy": "kuhn",
}
# The arms run when --arms is not given: the games' controls and their -mean arms. The chain's
# arms, nim-tree and kuhn-entropy run when named (`--arms all`), to keep the bench within its hour.
DEFAULT_ARMS = ("nim", "nim-mean", "kuhn", "kuhn-mean")
SEATS = ("first", "second")
OPPONENTS = ("random", "optimal")
NIM_TRAIN, NIM_HELD_OUT = (3, 4, 6, 8, 9), (5, 7)
NIM_TAKE = 3
# Settings that are not options: the demo's (docs/local.md), with a constant learning rate after
# the warm-up: arms stop at different steps when their budget is spent, and a decaying schedule
# would treat them differently.
TRAINER = {
    "lr_warmup_steps": 5,
    "lr_decay_style": "constant",
    "kl_coef": 0.1,
    "adam_eps": 1.0e-5,
    "warmup_sft_lr": 1.0e-3,
    "micro_batch_size": 64,
}
GAME_STEP = {False: (4, 4), True: (2, 4)}  # the games' (prompts, episodes per prompt) per step; --quick
MAX_NEW_TOKENS = {"chain": 10, "nim": 10, "kuhn": 16}  # per turn: "\\boxed{check}" and the end
# An illegal move must cost more than the worst legal result (nim: a loss, -1; kuhn: a called
# bet lost, -2), or a seat that has lost anyway loses nothing by it, and self-play learns to answer
# anything there (kuhn facing a bet with a weak card: folding costs 1 chip, so would the default -1).
ILLEGAL_PENALTY = {"nim": -2.0, "kuhn": -3.0}
WARMUP_EXAMPLES = 1000  # warm-start conversations per part
MAX_RESPONSE = 256  # per transcript: every turn of a seat and the messages between them


# The options whose default depends on --quick: option -> (default, with --quick, what it is).
SIZED: dict[str, tuple[int | str, int | str, str]] = {
    "budget": (6000, 24, "engine calls of each chain arm"),
    "nim_budget": (4000, 40, "engine calls of each nim arm"),
    "kuhn_budget": (3000, 32, "engine calls of each kuhn arm"),
    "snapshots": (
        12,
        3,
        "kuhn policies probed over training, the start and the last included: the average policy's",
    ),
    "prompts_per_step": (8, 2, "--rollout-batch-size"),
    "samples_per_prompt": (8, 4, "--n-samples-per-prompt; the tree-sampling arms run this / --branch"),
    "branch": (4, 2, "candidates per turn of the tree arms"),
    "eval_prompts": (100, 4, "held-out chains"),
    "eval_interval": (10, 2, "evaluate every N steps"),
    "probe_samples": (32, 2, "answers per probed position"),
    "probe_positions": (5, 1, "nim positions probed per starting pile"),
    "preset": ("tiny", "tiny", "model size (mrlx_plugin.local.model presets)"),
    "warmup_steps": (800, 2, "format-only supervised steps, every part's together"),
}


def build_parser() -> argparse.ArgumentParser:
    from mrlx_lab.bench import credit  # the benchmark's own docstring: what it measures

    p = argparse.ArgumentParser(prog="mrlx bench credit", description=(credit.__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--out", default="runs/bench-credit", help="the folder: credit.json, credit.png and every run"
    )
    p.add_argument("--seeds", type=int, default=5, help="N seeds from --seed-start (2 or more for intervals)")
    p.add_argument(
        "--seed-start", type=int, default=0, help="the first seed (tune on seeds other than those reported)"
    )
    p.add_argument("--only", choices=PARTS, default=None, help="run one part")
    p.add_argument(
        "--arms",
        default=None,
        help=f"comma-separated arms, or `all` (default: {', '.join(DEFAULT_ARMS)}; all: {', '.join(ARMS)})",
    )
    p.add_argument(
        "--jobs", type=int, default=2, help="units (one part of one seed) run at once; one thread each"
    )
    for key, (full, quick, what) in SIZED.items():  # filled in by `settle`
        p.add_argument(
            "--" + key.replace("_", "-"),
            type=type(full),
            default=None,
            help=f"{what} (default {full}" + (f"; --quick {quick})" if quick != full else ")"),
        )
    p.add_argument("--gamma", type=float, default=0.9, help="rewards.gamma of the chain's per-turn arms")
    p.add_argument("--chain-length", type=int, default=3, help="steps of each chain (turns per episode)")
    p.add_argument("--chain-max-start", type=int, default=5, help="chains start at 0 to this")
    p.add_argument("--chain-max-step", type=int, default=2, help="each step adds (or takes) 1 to this")
    p.add_argument("--chain-ops", default="+-", help="the operations of the steps, from + - *")
    p.add_argument(
        "--eval-samples",
        type=int,
        default=None,
        help="evaluation episodes per held-out prompt (default 2 per chain, 8 per nim pile and seat "
        "order; --quick 1)",
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--entropy-coef", type=float, default=0.01, help="mrlx.trainer.entropy_coef of the kuhn-entropy arm"
    )
    p.add_argument("--ppo-epochs", type=int, default=2, help="mrlx.trainer.ppo_epochs")
    p.add_argument("--quick", action="store_true", help="tiny settings (the test's smoke run)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--table",
        metavar="FILE.json",
        default=None,
        help="print the docs' tables from a saved report, and stop",
    )
    p.add_argument(
        "--collect",
        action="store_true",
        help="report the seeds of --out whose every unit has finished (a stopped run), and stop",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the units of --out that a stopped run (with the same options) finished; run the rest",
    )
    p.add_argument("--unit", default=None, help=argparse.SUPPRESS)  # SEED:PART, run for the parent
    p.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    return p


def settle(ns: argparse.Namespace) -> argparse.Namespace:
    """Fill in the defaults that depend on --quick, and check the options."""
    from mrlx_plugin.core.config import ConfigError

    for key, (full, quick, _) in SIZED.items():
        if getattr(ns, key) is None:
            setattr(ns, key, quick if ns.quick else full)
    for key in (*SIZED, "seeds", "jobs", "chain_length", "chain_max_step"):
        least = 0 if key == "warmup_steps" else 1
        if key != "preset" and getattr(ns, key) < least:
            raise ConfigError(f"--{key.replace('_', '-')}: got {getattr(ns, key)}; expected at least {least}")
    if ns.eval_samples is not None and ns.eval_samples < 1:
        raise ConfigError(f"--eval-samples: got {ns.eval_samples}; expected at least 1")
    if ns.branch < 2:
        raise ConfigError(f"--branch: got {ns.branch}; the tree arms need at least 2 candidates per turn")
    bad = set(ns.chain_ops) - set("+-*")
    if bad or not ns.chain_ops:
        raise ConfigError(f"--chain-ops: got {ns.chain_ops!r}; expected some of + - *")
    if ns.seed_start < 0:
        raise ConfigError(f"--seed-start: got {ns.seed_start}; expected at least 0")
    if ns.arms == "all":
        ns.arms = ",".join(ARMS)
    ns.arms = [a.strip() for a in ns.arms.split(",") if a.strip()] if ns.arms else list(DEFAULT_ARMS)
    for arm in ns.arms:
        if arm not in ARMS:
            raise ConfigError(f"--arms: no arm {arm!r}; the arms are {', '.join(ARMS)}")
    chosen = [a for a in ARMS if a in ns.arms and ns.only in (None, ARMS[a])]
    if not chosen and not ns.table:
        raise ConfigError(f"--arms {','.join(ns.arms)} and --only {ns.only}: no arm is left to run")
    if ns.samples_per_prompt % ns.branch and {"tree", "tree-random", "tree-old"} & set(chosen):
        raise ConfigError(
            f"--samples-per-prompt {ns.samples_per_prompt}: the tree arms run {ns.branch} times fewer "
            f"episodes per prompt (each turn costs {ns.branch} calls); make it a multiple of --branch"
        )
    if GAME_STEP[ns.quick][1] % ns.branch and "nim-tree" in chosen:
        raise ConfigError(
            f"--branch {ns.branch}: nim-tree runs {GAME_STEP[ns.quick][1]} episodes per prompt without tree "
            "sampling and that / --branch with it; use a --branch that divides it, or leave out nim-tree"
        )
    ns.arms = chosen
    return ns


def arm_settings(arm: str, ns: argparse.Namespace) -> tuple[JSONObject, JSONObject]:
    """The arm's `mrlx.rewards` and its `mrlx.game` additions."""
    tree = {"credit": "turn", "gamma": ns.gamma if ARMS[arm] == "chain" else 1.0, "branch": ns.branch}
    return {
        "episode": ({"credit": "episode"}, {}),
        "turn": ({"credit": "turn", "gamma": ns.gamma}, {}),
        "tree": ({**tree, "branch_pick": "best", "branch_target": "score"}, {"branch_score": "rollout"}),
        "tree-random": (
            {**tree, "branch_pick": "random", "branch_target": "score"},
            {"branch_score": "rollout"},
        ),
        "tree-old": (
            {**tree, "branch_pick": "best", "branch_target": "taken_return"},
            {"branch_score": "settle"},
        ),
        # A zero-sum game's outcome is its only reward: undiscounted, every move shares it.
        "nim": ({"credit": "turn", "gamma": 1.0}, {}),
        "nim-tree": ({**tree, "branch_pick": "best", "branch_target": "score"}, {"branch_score": "rollout"}),
        "kuhn": ({"credit": "turn", "gamma": 1.0}, {}),
        # A turn alone in its group (Kuhn's second seat, often; a nim position seen once) is
        # compared with a running mean of its group's earlier rewards instead of teaching nothing.
        "nim-mean": ({"credit": "turn", "gamma": 1.0, "lone_baseline": "running"}, {}),
        "kuhn-mean": ({"credit": "turn", "gamma": 1.0, "lone_baseline": "running"}, {}),
        "kuhn-entropy": ({"credit": "turn", "gamma": 1.0, "lone_baseline": "running"}, {}),
    }[arm]


def arm_trainer(arm: str, ns: argparse.Namespace) -> JSONObject:
    """The arm's `mrlx.trainer` additions to TRAINER: the `-mean` arms' advantages are centred
    but not divided by the group's spread (at two samples a group, dividing makes the expected
    update follow the sign of the difference, not the policy gradient); `kuhn-entropy` adds an
    entropy bonus to that."""
    if arm in ("nim-mean", "kuhn-mean"):
        return {"grpo_std_normalization": False}
    if arm == "kuhn-entropy":
        return {"grpo_std_normalization": False, "entropy_coef": ns.entropy_coef}
    return {}
