"""Structured (JSON) logs, quiet by default: lifecycle at INFO, per-event detail at DEBUG."""

from __future__ import annotations

import logging
import os
import sys

from pythonjsonlogger.json import JsonFormatter


def setup_logging(level: str | None = None) -> None:
    """Configures the root logger once for a process; DILOCO_LOG_LEVEL overrides the default INFO."""
    chosen = (level or os.environ.get("DILOCO_LOG_LEVEL") or "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(chosen)
