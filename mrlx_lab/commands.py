"""The commands the lab adds to `mrlx`, registered in setup.cfg as entry points of the group
`mrlx_plugin.commands`: `demo`, `bench` and `stub-engine`. Each imports what it runs only when it
runs, so that `mrlx --help`, which reads them all, stays quick."""

from __future__ import annotations

from mrlx_plugin.cli.commands import Command


def _demo(argv: list[str]) -> int:
    from mrlx_lab.demos.cli import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    from mrlx_lab.bench import main

    return main(argv)


def _stub_engine(argv: list[str]) -> int:
    from mrlx_lab.stub_engine.command import main

    return main(argv)


demo = Command(
    _demo,
    "two small models co-train on this CPU (--adapters; --long-tail: sync vs async; --tools, --research: "
    "the agent-code examples)",
)
bench = Command(
    _bench, "benchmarks: rollout, coordinator, demo, load, answers, credit, agents, tools, requests, async"
)
stub_engine = Command(
    _stub_engine, "a model-free SGLang-protocol responder for benchmarks and fault tests", serves=True
)
