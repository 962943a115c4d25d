"""Reading a store's doctor checks (``diagnose()``) in the tests."""

from __future__ import annotations

from celery_dlock.backends.base import Check


def by_name(checks: list[Check]) -> dict[str, Check]:
    """``checks`` by their name, in the order the doctor gave them."""
    return {check.name: check for check in checks}
