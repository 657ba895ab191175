"""Stands in for `miles.utils.logging_utils`. Like Miles' it configures Python logging only:
it has NO `log` function (metrics go through `miles.utils.tracking_utils.tracking.log`)."""

from __future__ import annotations

import logging


def configure_logger_raw(name: str = "") -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"[%(asctime)s{' ' + name if name else ''}] %(levelname)s %(name)s: %(message)s",
    )
