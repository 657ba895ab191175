"""`mrlx demo` as the tests run it: the tiny preset, a short warm-up, small steps, quiet."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHORT = [
    "--preset",
    "tiny",
    "--prompts-per-step",
    "2",
    "--samples-per-prompt",
    "2",
    "--warmup-steps",
    "2",
    "--quiet",
]


def demo(out: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run the short demo into `out` with `extra` flags, to its end."""
    return subprocess.run(
        [sys.executable, "-m", "mrlx_plugin.cli", "demo", "--out", str(out), *SHORT, *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
