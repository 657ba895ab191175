"""`mrlx demo`: the main demo (`co_training`, with `--adapters` its variant), with `--long-tail` its
two agents on a long-tail workload sync against async (`long_tail`), or with `--tools` or
`--research` an agent-code example instead; the rest of the command line is that demo's."""

from __future__ import annotations

import importlib
import sys

VARIANTS = {
    "--tools": "mrlx_lab.demos.tools",
    "--research": "mrlx_lab.demos.research",
    "--long-tail": "mrlx_lab.demos.long_tail",
}


def main(argv: list[str]) -> int:
    chosen = [a for a in argv if a in VARIANTS]
    if len(chosen) > 1:
        print(f"mrlx demo: give one of {', '.join(VARIANTS)}, not {' and '.join(chosen)}", file=sys.stderr)
        return 2
    module = VARIANTS[chosen[0]] if chosen else "mrlx_lab.demos.co_training"
    return importlib.import_module(module).main([a for a in argv if a not in chosen])
