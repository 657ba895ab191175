"""The functions the host's flags name.

    --custom-generate-function-path     mrlx_plugin.rollout.generate
    --custom-reward-post-process-path   mrlx_plugin.rewards.normalize
    --custom-rollout-log-function-path  mrlx_plugin.metrics.log_rollout
    --custom-rm-path                    mrlx_plugin.rewards.reward      (optional)
    --custom-config-path                your.yaml                       (an `mrlx:` key)

`generate` runs one multi-agent episode per input sample. slime calls it as
`generate(args, sample, sampling_params, evaluation=...)`; Miles calls that same form (it adapts
3+-parameter functions) or passes one `GenerateFnInput`; both work.
"""

from __future__ import annotations

import argparse
from typing import Any

from .episode import run_episode
from .host import unpack_generate_call, wrap_generate_output
from .runtime import get_runtime


async def generate(args: Any, sample: Any = None, sampling_params: Any = None, evaluation: bool = False) -> Any:
    """Run one episode of the configured agent system on `sample`.

    Training returns a list of samples (every agent this job trains, all with the input's
    rollout id and a reward set); evaluation returns one sample holding the team's final answer
    and its grade. Engine faults never raise: they come back as ABORTED samples with reward 0.0
    and a zero loss mask. Settings errors raise ConfigError on the first call.
    """
    args, sample, sampling_params, evaluation, miles_input = unpack_generate_call(
        args, sample, sampling_params, evaluation
    )
    runtime = await get_runtime(args)
    result = await run_episode(runtime, sample, sampling_params, evaluation)
    return wrap_generate_output(result, miles_input)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Miles calls this on the object named by --custom-generate-function-path or
    --rollout-function-path: it adds `--mrlx-config PATH`, read when the `--custom-config-path`
    YAML carries no `mrlx:` key."""
    if any("--mrlx-config" in action.option_strings for action in parser._actions):
        return
    parser.add_argument(
        "--mrlx-config",
        type=str,
        default=None,
        help="mrlx_plugin settings: a YAML file with a top-level 'mrlx:' key (or base64:<payload>)",
    )


generate.add_arguments = add_arguments  # type: ignore[attr-defined]
