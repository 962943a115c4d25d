"""Support shared by the test modules: how a test says a real server is missing."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

REQUIRE_ALL = os.environ.get("DLOCK_REQUIRE_ALL") == "1"


def unavailable(what: str) -> NoReturn:
    """Skip for a missing server or package, visibly; fail under ``DLOCK_REQUIRE_ALL=1``."""
    if REQUIRE_ALL:
        pytest.fail(f"{what} (DLOCK_REQUIRE_ALL=1 turns this skip into a failure)")
    pytest.skip(what)
