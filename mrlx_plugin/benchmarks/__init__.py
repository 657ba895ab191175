"""`mrlx bench NAME`: benchmarks that print a table and write JSON.

    mrlx bench rollout       plugin overhead per model call, pipeline wall time vs its critical
                             path, memory of many concurrent episodes (against stub engines)
    mrlx bench coordinator   durable commit-then-lease throughput and barrier wake-up latency,
                             against a plain in-memory JSON queue
    mrlx bench demo          the CPU demo and its frozen-B baseline: time, rewards, memory
    mrlx bench load          10,000 concurrent two-model episodes, the coordinator under
                             backpressure, and a 10-minute soak watching memory and open files
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def write_report(path: str | Path, report: dict[str, Any]) -> Path:
    """Write a benchmark's report as JSON (creating its directory) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"  -> {out}")
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "rollout":
        from .rollout import main as run
    elif name == "coordinator":
        from ..coordinator.bench import main as run
    elif name == "demo":
        from .demo import main as run
    elif name == "load":
        from .load import main as run
    else:
        print(f"mrlx bench: unknown benchmark {name!r} (rollout, coordinator, demo, load)", file=sys.stderr)
        return 2
    return run(rest)
