"""`mrlx bench agents`: what writing a system as agent code costs, against the built-in system.

The same workload as `mrlx bench rollout` (pipeline episodes of ~2k-token problems, num_parallel 5:
11 model calls each, the host's generate function driven as slime does, stub engines in their own
processes), run three ways in one run, each in a fresh rollout process:

- the built-in `system: pipeline`;
- the pipeline as agent code (`mrlx_lab.examples.pipeline_as_code`), its turns sent as plain HTTP
  (`mrlx_lab.bench.agent_pipelines`): the endpoint's own cost;
- the same agent code with the official `openai` client, as the example is written: the
  endpoint's cost plus the client's;
- the same through each other API and its official client: chat completions streamed, the
  Responses API, Anthropic's Messages API, and chat completions over the in-process transport
  (`mrlx_plugin.agents.local_client`: no socket) (`mrlx_lab.bench.agent_pipelines`).

For each: model calls per second and the rollout process's CPU milliseconds per call on one core
(the endpoints, the user code and its client all run in that process), and 64 concurrent episodes
against a stub answering after 1 s: wall time over the critical path (3 calls = 3 s). Goals: at
most 1 ms CPU per call beyond the built-in system, and within 1.10 of the critical path.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mrlx_lab.bench.engine_calls import _run_worker, pinned_stubs, prepare
from mrlx_lab.bench.report import write_report

_CODE = "mrlx_lab.bench.agent_pipelines"
ARMS = (
    ("built-in pipeline", "pipeline", ""),
    ("agent code, plain HTTP", "pipeline_code_http", _CODE),
    ("openai chat completions", "pipeline_code", "mrlx_lab.examples.pipeline_as_code.hooks"),
    ("openai chat, streamed", "pipeline_code_stream", _CODE),
    ("openai responses", "pipeline_code_responses", _CODE),
    ("anthropic messages", "pipeline_code_anthropic", _CODE),
    ("openai chat, in-process", "pipeline_code_local", _CODE),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mrlx bench agents", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/bench/agents.json")
    p.add_argument("--workdir", default="runs/bench")
    p.add_argument("--episodes", type=int, default=400, help="throughput run: pipeline episodes")
    p.add_argument("--concurrency", type=int, default=64, help="throughput run: episodes in flight")
    p.add_argument("--path-episodes", type=int, default=64, help="critical-path run: concurrent episodes")
    p.add_argument("--latency", type=float, default=1.0, help="seconds per call of the slow stub")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--response-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--arms", nargs="+", metavar="SYSTEM", help="only these arms (their systems, e.g. pipeline_code)"
    )
    ns = p.parse_args(argv)
    arms_run = [a for a in ARMS if ns.arms is None or a[1] in ns.arms or a[1] == "pipeline"]

    workdir = Path(ns.workdir)
    tokenizer, problems, mean_prompt = prepare(workdir, ns.prompt_tokens, ns.seed)
    arms = {}
    with pinned_stubs(workdir, tokenizer, ns.response_tokens, ns.latency) as (instant, slow, cpu):
        kw = dict(num_parallel=5, response_tokens=ns.response_tokens, cpu=cpu)
        for name, system, plugins in arms_run:
            throughput = _run_worker(
                "throughput",
                instant.url,
                tokenizer,
                problems,
                episodes=ns.episodes,
                concurrency=ns.concurrency,
                warmup=32,
                system=system,
                plugins=plugins,
                **kw,
            )
            path = _run_worker(
                "critical_path",
                slow.url,
                tokenizer,
                problems,
                episodes=ns.path_episodes,
                concurrency=ns.path_episodes,
                warmup=ns.path_episodes,
                system=system,
                plugins=plugins,
                **kw,
            )
            path["ratio"] = path["wall_s"] / (3 * ns.latency)
            arms[name] = {"system": system, "throughput": throughput, "critical_path": path}
    cpus = len(os.sched_getaffinity(0))

    base = arms[ARMS[0][0]]["throughput"]["cpu_ms_per_call"]
    print(
        f"mrlx bench agents  (prompts ~{round(mean_prompt)} tokens, {ns.response_tokens}-token answers, "
        f"num_parallel 5, {cpus} CPUs{', rollout pinned to one core' if cpu is not None else ''})"
    )
    header = ("arm", "calls/s", "CPU ms/call", "beyond built-in", "wall / critical path", "goals")
    print(f"  {header[0]:<28}{header[1]:>9}{header[2]:>13}{header[3]:>17}{header[4]:>22}{header[5]:>7}")
    for name, arm in arms.items():
        t, c = arm["throughput"], arm["critical_path"]
        extra = t["cpu_ms_per_call"] - base
        arm["cpu_ms_beyond_builtin"] = extra
        beyond = "-" if arm["system"] == "pipeline" else f"{extra:+.3f}"
        arm["meets_goals"] = extra <= 1.0 and c["ratio"] <= 1.10
        print(
            f"  {name:<28}{t['calls_per_s']:>9.0f}{t['cpu_ms_per_call']:>13.3f}{beyond:>17}"
            f"{c['ratio']:>22.3f}{'met' if arm['meets_goals'] else 'MISSED':>7}"
        )
    print("  goals: <= 1 ms CPU per call beyond the built-in system; wall / critical path <= 1.10")
    write_report(
        ns.out,
        {
            "machine": {"cpus": cpus, "python": sys.version.split()[0]},
            "workload": {"mean_prompt_tokens": round(mean_prompt), "response_tokens": ns.response_tokens},
            "arms": arms,
        },
    )
    return 0
