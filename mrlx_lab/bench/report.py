"""What the benchmarks share: where a report goes (JSON on disk, its path printed under the
table), and the mean over seeds with its 95% interval."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from pathlib import Path

# Two-sided 95% quantiles of Student's t by degrees of freedom (n - 1); 1.96 past the table.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def write_report(path: str | Path, report: Mapping[str, object]) -> Path:
    """Write a benchmark's report as JSON (creating its directory) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(f"  -> {out}")
    return out


def interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its 95% interval (Student's t); (mean, mean, mean) for a
    single value."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = _T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half
