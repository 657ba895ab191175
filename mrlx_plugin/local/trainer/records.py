"""The trainer's JSON-lines files (metrics.jsonl, samples.jsonl, warm-start data): reading them
(the demos and benchmarks read a trainer's metrics the same way), appending a row, and cutting
them back to the steps a resumed checkpoint holds."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

from mrlx_plugin.core.values import JSONObject


def read_rows(path: Path, growing: bool = False) -> list[JSONObject]:
    """The rows of a JSON-lines file (a trainer's metrics.jsonl, warm-start data); none when the
    file is not there yet. `growing`: a file another process is appending to (`append_row` writes
    whole lines): a last line without its newline is still being written, and is read next time."""
    if not path.exists():
        return []
    text = path.read_text()
    if growing and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def drop_rows_from(path: Path, step: int) -> None:
    """Keep only the rows of `path` of steps before `step` (and the warm-start's, step -1)."""
    if not path.exists():
        return
    keep = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", -1) < step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)


def append_row(path: Path, row: Mapping[str, object]) -> None:
    """`row` as one JSON line at the end of `path`; a float that is not finite is written null."""
    clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in row.items()}
    with path.open("a") as f:
        f.write(json.dumps(clean, default=str) + "\n")
