"""The `mrlx` command.

    mrlx demo ...          two small models co-train on a CPU (the embedded default, end to end);
                           --tools: a tool-using agent as code; --research: a planner-searcher pair
    mrlx engine ...        an embedded SGLang-protocol engine on the CPU
    mrlx stub-engine ...   a model-free SGLang-protocol responder (benchmarks, fault tests)
    mrlx rollout ...       run episodes of the configured system against engines; write JSONL
    mrlx check ...         validate configs and reach every URL before any GPU is used
    mrlx coordinator ...   the coordinator service of a multi-model run
    mrlx bench ...         benchmarks (print a table, write JSON)

A command that starts processes stops them all when it ends: normally, on an exception, and on
SIGTERM, SIGINT or SIGHUP (each becomes `Stopped`, raised in the main thread, so that every
`finally` and ExitStack on the way runs); see `mrlx_plugin.core.processes` for what happens
when it is SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

from mrlx_plugin.core.config import ConfigError


def _engine(argv: list[str]) -> int:
    from mrlx_plugin.local.engine import main

    return main(argv)


def _stub_engine(argv: list[str]) -> int:
    from mrlx_plugin.local.stub_engine import main

    return main(argv)


def _coordinator(argv: list[str]) -> int:
    from mrlx_plugin.coordinator.server import main

    return main(argv)


def _rollout(argv: list[str]) -> int:
    from mrlx_plugin.cli.run_episodes import main

    return main(argv)


def _check(argv: list[str]) -> int:
    from mrlx_plugin.cli.check import main

    return main(argv)


# `mrlx demo --tools` and `mrlx demo --research` run the agent-code examples instead of the main demo.
_DEMO_VARIANTS = {"--tools": "mrlx_plugin.local.tool_demo", "--research": "mrlx_plugin.local.research_demo"}


def _demo(argv: list[str]) -> int:
    import importlib

    chosen = [a for a in argv if a in _DEMO_VARIANTS]
    if len(chosen) > 1:
        print(
            f"mrlx demo: give one of {', '.join(_DEMO_VARIANTS)}, not {' and '.join(chosen)}", file=sys.stderr
        )
        return 2
    module = _DEMO_VARIANTS[chosen[0]] if chosen else "mrlx_plugin.local.demo"
    return importlib.import_module(module).main([a for a in argv if a not in chosen])


def _bench(argv: list[str]) -> int:
    from mrlx_plugin.bench import main

    return main(argv)


class Stopped(KeyboardInterrupt):
    """SIGTERM, SIGINT or SIGHUP arrived: the command unwinds, stopping what it started."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# These serve until SIGTERM/SIGINT with their own handlers (a graceful shutdown); they start nothing.
SERVERS = ("engine", "stub-engine", "coordinator")


def stop_on_signals() -> None:
    """Turn SIGTERM, SIGINT and SIGHUP into `Stopped` in the main thread. The first one wins:
    after it, all three are ignored, so that a second Ctrl-C cannot cut the clean-up short (a
    SIGKILL still can; the kernel then ends the children, see `core.processes.tied`). A signal
    this process was started with ignored (nohup, a shell's background job) stays ignored."""

    def handler(signum: int, frame: object) -> None:
        for s in STOP_SIGNALS:
            if signal.getsignal(s) is handler:
                signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    for s in STOP_SIGNALS:
        if signal.getsignal(s) is not signal.SIG_IGN:
            signal.signal(s, handler)


COMMANDS: dict[str, tuple[Callable[[list[str]], int], str]] = {
    "engine": (_engine, "serve a small transformers model over the SGLang HTTP protocol (CPU)"),
    "stub-engine": (_stub_engine, "a model-free SGLang-protocol responder for benchmarks and fault tests"),
    "demo": (
        _demo,
        "two small models co-train on this CPU (--tools, --research: the agent-code examples)",
    ),
    "rollout": (
        _rollout,
        "run N episodes of a system against engines; print a summary; write samples as JSONL",
    ),
    "check": (_check, "validate configs (and two jobs' configs against each other); reach every URL"),
    "coordinator": (_coordinator, "the durable coordinator of a multi-model run"),
    "bench": (_bench, "benchmarks: rollout, coordinator, demo, load, answers, credit, agents, tools"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mrlx COMMAND [options]   (mrlx COMMAND --help for each)\n")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<13} {help_text}")
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from mrlx_plugin import __version__

        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    # Hook modules named in a config (users' own code, e.g. `my_rewards.score`) are imported like
    # `python -m` would: from the current directory first, then PYTHONPATH. The console script's
    # sys.path lacks the current directory, unlike `python -m`; nothing of the package needs this.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if name not in COMMANDS:
        print(f"mrlx: unknown command {name!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if name not in SERVERS:
        stop_on_signals()
    try:
        return COMMANDS[name][0](rest)
    except ConfigError as exc:
        print(f"mrlx {name}: {exc}", file=sys.stderr)
        return 2
    except Stopped as exc:
        print(f"mrlx {name}: stopped by {signal.Signals(exc.signum).name}", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
