"""Live processes, read from /proc: what a test checks a run left behind."""

from __future__ import annotations

import os
from pathlib import Path


def processes_naming(text: str) -> list[str]:
    """Command lines of live processes that mention `text` (the run's own directory)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline[:200]}")
    return found
