"""The `mrlx` command.

    mrlx engine ...        an embedded SGLang-protocol engine on the CPU
    mrlx rollout ...       run episodes of the configured system against engines; write JSONL
    mrlx check ...         validate configs and reach every URL before any GPU is used
    mrlx coordinator ...   the coordinator service of a multi-model run

and the commands installed packages add (`mrlx_plugin.cli.commands`): the lab's `mrlx demo` (two
small models co-train on a CPU; --tools, --research: agent-code examples), `mrlx bench` and
`mrlx stub-engine`. `mrlx --help` lists what is installed.

A command that starts processes stops them all when it ends: normally, on an exception, and on
SIGTERM, SIGINT or SIGHUP (each becomes `Stopped`, raised in the main thread, so that every
`finally` and ExitStack on the way runs); see `mrlx_plugin.core.processes` for what happens
when it is SIGKILLed.
"""

from __future__ import annotations

import os
import signal
import sys

from mrlx_plugin.cli.commands import every_command, find
from mrlx_plugin.core.config import ConfigError


class Stopped(KeyboardInterrupt):
    """SIGTERM, SIGINT or SIGHUP arrived: the command unwinds, stopping what it started."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mrlx COMMAND [options]   (mrlx COMMAND --help for each)\n")
        for name, command in every_command().items():
            print(f"  {name:<13} {command.help}")
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
    command = find(name)
    if command is None:
        print(f"mrlx: unknown command {name!r}; commands: {', '.join(every_command())}", file=sys.stderr)
        return 2
    if not command.serves:
        stop_on_signals()
    try:
        return command.run(rest)
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
