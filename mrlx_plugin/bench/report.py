"""Where a benchmark's report goes: JSON on disk, its path printed under the table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(path: str | Path, report: dict[str, Any]) -> Path:
    """Write a benchmark's report as JSON (creating its directory) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"  -> {out}")
    return out
