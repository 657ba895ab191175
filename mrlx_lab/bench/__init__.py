"""`mrlx bench NAME`: benchmarks that print a table and write JSON. They ship in the wheel with the
rest of the lab (`mrlx_lab.bench`), so `mrlx bench` and the helper processes a benchmark starts
import them like any other module; they import the product, never the other way round.

    mrlx bench rollout       plugin overhead per model call, pipeline wall time vs its critical
                             path, memory of many concurrent episodes (against stub engines)
    mrlx bench coordinator   durable commit-then-lease throughput and barrier wake-up latency,
                             against a plain in-memory JSON queue
    mrlx bench demo          the CPU demo and its frozen-B baseline: time, rewards, memory
    mrlx bench load          10,000 concurrent two-model episodes, the coordinator under
                             backpressure, and a 10-minute soak watching memory and open files
    mrlx bench answers       how long hostile engine answers hold the rollout's event loop, and
                             their memory, against a well-formed answer
    mrlx bench credit        episode vs turn credit vs tree sampling on a multi-turn task at
                             equal engine calls, nim and Kuhn poker by self-play (over seeds)
    mrlx bench agents        the pipeline as agent code (plain HTTP, the openai client) against
                             the built-in pipeline: CPU per call and the critical path
    mrlx bench tools         the tool-using example (`mrlx demo --tools`) from scratch: its
                             learning curve, well-formed tool calls, time and memory
    mrlx bench requests      how long hostile chat-completions requests (huge message lists,
                             tools, bodies) hold the agent endpoint's event loop, and their memory
    mrlx bench async         the demo's two agents on a long-tail workload, synchronous against
                             fully asynchronous rollouts over seeds: trainer idle, samples/s,
                             staleness, reward curves
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "rollout":
        from mrlx_lab.bench.engine_calls import main as run
    elif name == "coordinator":
        from mrlx_lab.bench.coordinator.run import main as run
    elif name == "demo":
        from mrlx_lab.bench.demo import main as run
    elif name == "load":
        from mrlx_lab.bench.load import main as run
    elif name == "answers":
        from mrlx_lab.bench.answer_stall import main as run
    elif name == "credit":
        from mrlx_lab.bench.credit.run import main as run
    elif name == "agents":
        from mrlx_lab.bench.agents import main as run
    elif name == "tools":
        from mrlx_lab.bench.tools import main as run
    elif name == "requests":
        from mrlx_lab.bench.request_stall import main as run
    elif name == "async":
        from mrlx_lab.bench.long_tail import main as run
    else:
        print(
            f"mrlx bench: unknown benchmark {name!r} "
            "(rollout, coordinator, demo, load, answers, credit, agents, tools, requests, async)",
            file=sys.stderr,
        )
        return 2
    return run(rest)
