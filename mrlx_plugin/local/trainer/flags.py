"""The embedded trainer's command line: slime's flag names for what slime would be given (the
host's own flags, `fake_host.add_host_arguments`), and the trainer's own."""

from __future__ import annotations

import argparse

TRAINER_DESCRIPTION = "The embedded CPU trainer: one agent's slime job, on a CPU, readable top to bottom."


def build_parser() -> argparse.ArgumentParser:
    from mrlx_plugin.local.trainer.fake_host import add_host_arguments

    p = argparse.ArgumentParser(prog="python -m mrlx_plugin.local.trainer", description=TRAINER_DESCRIPTION)
    p.add_argument("--config", required=True, help="the job's YAML (mrlx: ..., with mrlx.trainer)")
    p.add_argument("--model", required=True, help="the agent's initial model directory")
    p.add_argument(
        "--adapter",
        default=None,
        metavar="DIR",
        help="train a LoRA adapter on --model (the base), starting from this peft directory; the engine "
        "serves it under the trained agent's `adapter` setting",
    )
    p.add_argument(
        "--engine-url", action="append", default=[], help="this agent's engine(s), for weight pushes"
    )
    p.add_argument(
        "--rollout-function",
        default="mrlx_plugin.local.trainer.fake_host.default_rollout",
        help="what slime's --rollout-function-path would name",
    )
    p.add_argument("--custom-generate-function-path", default="mrlx_plugin.rollout.generate")
    p.add_argument("--num-rollout", type=int, default=10)
    p.add_argument(
        "--task",
        default="arithmetic",
        help="built-in prompts (mrlx_plugin.local.trainer.tasks) when no --prompt-data",
    )
    p.add_argument("--task-size", type=int, default=256, help="how many built-in prompts")
    p.add_argument(
        "--warmup-data", default=None, help="JSONL of {'messages': [...]} for the supervised warm-start"
    )
    p.add_argument("--out", required=True, help="checkpoints, metrics.jsonl and samples go here")
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument(
        "--freeze", action="store_true", help="no RL updates (the warm-start still runs): a baseline"
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-samples", action="store_true", help="write every trained sample to samples.jsonl")
    p.add_argument(
        "--eval-interval",
        type=int,
        default=None,
        help="evaluate before the first step, after every N steps and after the last (slime's flag); "
        "needs --eval-prompt-data",
    )
    p.add_argument(
        "--eval-prompt-data",
        nargs="+",
        default=None,
        metavar="[NAME] FILE",
        help="JSONL of held-out prompts for evaluation episodes; or NAME FILE pairs (slime's form), each "
        "evaluated under every --eval-config, as set CONFIG/NAME",
    )
    p.add_argument(
        "--n-samples-per-eval-prompt", type=int, default=1, help="evaluation episodes per held-out prompt"
    )
    p.add_argument(
        "--eval-config",
        action="append",
        default=[],
        metavar="[NAME=]FILE",
        help="YAML of the evaluation episodes (default: --config, as set `eval`); repeat for several "
        "sets, e.g. one per seat order of a game",
    )
    p.add_argument(
        "--engine-call-budget",
        type=int,
        default=None,
        help="stop after the step at which the engine calls spent in training (every step's episodes "
        "x its `multi_agent/engine_calls`) reach this, evaluating first; --num-rollout stays the most "
        "steps. Runs compared at one budget spend the same calls, past it by at most one step",
    )
    add_host_arguments(p)
    return p
