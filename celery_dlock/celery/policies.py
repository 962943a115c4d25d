"""Calling a task option that is a callable (``on_locked``, ``on_duplicate``,
``on_lock_lost``) the one way the README documents: with the task first."""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["call_policy"]


def call_policy(task: Any, name: str, *args: Any) -> Any:
    """Call ``task``'s option ``name`` as ``(task, *args)``, whatever kind of callable it
    is: a function set on the task class (which reading it from the task would bind), a
    ``staticmethod``, a callable object or a ``functools.partial``."""
    raw = inspect.getattr_static(task, name)
    if isinstance(raw, staticmethod):
        raw = raw.__func__
    return raw(task, *args)
