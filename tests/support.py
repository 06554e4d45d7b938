"""Helpers every test tier shares (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NoReturn

import pytest


def wait_until(condition: Callable[[], object], timeout: float = 10.0, interval: float = 0.02) -> object:
    """Polls `condition` until it returns something truthy (returned), failing the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s: {getattr(condition, '__name__', condition)}")
        time.sleep(interval)


def missing_binary(message: str) -> NoReturn:
    """A developer without the cluster binaries skips; CI, which builds them first (.ci/run), fails, so a
    tier can never vanish silently."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
