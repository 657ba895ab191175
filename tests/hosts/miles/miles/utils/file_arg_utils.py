"""Stands in for `miles.utils.file_arg_utils`: a flag value that is a file path or `base64:<payload>`."""

from __future__ import annotations

import base64
from pathlib import Path

PSEUDO_FILE_PREFIX = "base64:"


def resolve_file_arg(value: str) -> str:
    if value.startswith(PSEUDO_FILE_PREFIX):
        return base64.b64decode(value[len(PSEUDO_FILE_PREFIX) :], validate=True).decode()
    return Path(value).read_text(encoding="utf-8")
