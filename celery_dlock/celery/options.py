"""The options of a ``LockedTask`` subclass, checked when the task is defined."""

from __future__ import annotations

from typing import Any

from celery_dlock.backends.base import validate_ttl
from celery_dlock.celery import dedupe
from celery_dlock.errors import ConfigurationError
from celery_dlock.lock import DEFAULT, validate_limit, validate_wait

__all__ = ["ON_LOCKED", "ON_LOST", "check_options"]

ON_LOCKED = ("retry", "skip", "fail")
ON_LOST = ("log", "raise")


def check_options(cls: Any, name: str, *, several: bool = False) -> None:
    """Refuse bad task options when the task is defined, naming the task."""
    try:
        if cls.lock_ttl is not DEFAULT:
            validate_ttl(cls.lock_ttl)
        try:
            validate_wait(cls.lock_wait)
        except ConfigurationError as exc:
            raise ConfigurationError(f"lock_wait: {exc}") from None
        if not callable(cls.on_locked) and cls.on_locked not in ON_LOCKED:
            choices = ", ".join(ON_LOCKED)
            raise ConfigurationError(
                f"on_locked must be one of {choices} or a callable, not {cls.on_locked!r}"
            )
        if not callable(cls.on_lock_lost) and cls.on_lock_lost not in ON_LOST:
            raise ConfigurationError(
                f"on_lock_lost must be 'log', 'raise' or a callable, not {cls.on_lock_lost!r}"
            )
        validate_limit(cls.lock_limit)
        if several and (cls.once or cls.lock_limit > 1):
            raise ConfigurationError(
                "a list of lock_key templates takes every key, all or none: it goes with "
                "neither once nor lock_limit"
            )
        if cls.once and cls.lock_limit > 1:
            raise ConfigurationError(
                "once needs lock_limit=1: several runs at once could each run the body before "
                "one of them succeeds"
            )
        if cls.dedupe is not None and cls.dedupe not in dedupe.MODES:
            modes = ", ".join(dedupe.MODES)
            raise ConfigurationError(f"dedupe must be None, {modes}, not {cls.dedupe!r}")
        if not callable(cls.on_duplicate) and cls.on_duplicate not in dedupe.ON_DUPLICATE:
            raise ConfigurationError(
                f"on_duplicate must be 'return', 'raise' or a callable, not {cls.on_duplicate!r}"
            )
        if cls.lock_metadata is not None and not callable(cls.lock_metadata):
            raise ConfigurationError(
                "lock_metadata must be a callable of the task's arguments giving a dict, "
                f"not {cls.lock_metadata!r}"
            )
        if cls.dedupe_ttl is not None:
            validate_ttl(cls.dedupe_ttl)
        for option in ("once", "lock_across_retries"):
            if not isinstance(getattr(cls, option), bool):
                raise ConfigurationError(
                    f"{option} must be True or False, not {getattr(cls, option)!r}"
                )
        retry_max = cls.lock_retry_max
        if retry_max is not None and (
            isinstance(retry_max, bool) or not isinstance(retry_max, int) or retry_max < 0
        ):
            raise ConfigurationError(
                f"lock_retry_max must be None or a whole number >= 0, not {retry_max!r}"
            )
        for option in ("lock_retry_backoff", "lock_retry_backoff_max"):
            value = getattr(cls, option)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigurationError(f"{option} must be seconds > 0, not {value!r}")
    except ConfigurationError as exc:
        raise ConfigurationError(f"task {name}: {exc}") from None
