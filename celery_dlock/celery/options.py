"""The options of a ``LockedTask`` subclass, checked when the task is defined."""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from types import FunctionType
from typing import Any

from celery import Task

from celery_dlock.backends.base import validate_ttl
from celery_dlock.celery import dedupe
from celery_dlock.errors import ConfigurationError, LockKeyError
from celery_dlock.keys import KeyTemplate, validate_limit
from celery_dlock.lock import DEFAULT, validate_wait

__all__ = ["ON_LOCKED", "ON_LOST", "OURS", "check_base", "check_options", "define"]

ON_LOCKED = ("retry", "skip", "fail")
ON_LOST = ("log", "raise")
#: The beginnings of our option names: a task attribute so named that no base class defines
#: is a misspelt option (Celery makes every ``@app.task`` keyword a class attribute, and
#: ``lock_tll=5`` would otherwise run with no ttl). Celery's ``Task`` has no such name.
OURS = ("lock_", "dlock_", "dedup", "on_lock", "on_dup", "once")
#: What a base class defines that is not an option (``lock_key_for``, ``leases``).
_NOT_OPTIONS = (FunctionType, property, classmethod, staticmethod)


def define(cls: Any, locked: type) -> tuple[KeyTemplate, ...] | None:
    """The key templates of ``cls``, a subclass of ``locked`` (``LockedTask``) being
    defined, its options checked; None for an abstract base of the user's own (a class
    without a body), checked for misspelt options only.

    Raises:
        ConfigurationError: a bad option, or a base whose ``__call__`` would be skipped.
        LockKeyError: no ``lock_key``, or a template that does not fit the body.
    """
    _check_call_order(cls, locked)
    run = cls.__dict__.get("run")
    if run is None and cls.lock_key is not None:
        # A subclass of a task class (``class Urgent(Charge): lock_key = ...``) runs the
        # body it inherits: with its own key and options, not its parent's.
        run = inspect.getattr_static(cls, "run")
        run = None if run is Task.__dict__["run"] else run
    if run is None:
        check_base(cls)
        return None
    name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__qualname__}"
    if cls.lock_key is None:
        raise LockKeyError(f"task {name} has base=LockedTask but no lock_key")
    func = run.__func__ if isinstance(run, staticmethod) else functools.partial(run, None)
    given = cls.lock_key if isinstance(cls.lock_key, (list, tuple)) else [cls.lock_key]
    if not given or any(isinstance(t, str) and not t.strip() for t in given):
        raise LockKeyError(f"task {name}: lock_key must be templates that are not empty")
    templates = tuple(KeyTemplate(template, func, namespace="", owner=name) for template in given)
    check_options(cls, name, several=len(given) > 1)
    return templates


def _check_call_order(cls: Any, locked: type) -> None:
    """Refuse a base after ``locked`` in the MRO that defines ``__call__``: ``locked``'s
    ``__call__`` runs the body itself and would skip it without a word."""
    mro = cls.__mro__
    for base in mro[mro.index(locked) + 1 : mro.index(Task)]:
        if "__call__" in vars(base):
            raise ConfigurationError(
                f"class {cls.__name__}: {base.__name__} defines __call__, which "
                f"{locked.__name__} would skip: put {base.__name__} before "
                f"{locked.__name__} in the bases"
            )


def check_options(cls: Any, name: str, *, several: bool = False) -> None:
    """Refuse bad task options when the task is defined, naming the task."""
    try:
        _refuse_unknown(cls)
        _check_lock(cls, several)
        _check_choices(cls)
        _check_retries(cls)
    except ConfigurationError as exc:
        raise ConfigurationError(f"task {name}: {exc}") from None


def _check_lock(cls: Any, several: bool) -> None:
    """The lease's options: ttl, wait, limit, and what goes with a list of keys or once."""
    _named("lock_ttl", validate_ttl, cls.lock_ttl, unless=DEFAULT)
    _named("lock_wait", validate_wait, cls.lock_wait)
    _named("lock_limit", validate_limit, cls.lock_limit)
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
    _named("dedupe_ttl", validate_ttl, cls.dedupe_ttl, unless=None)
    if cls.lock_metadata is not None and not callable(cls.lock_metadata):
        raise ConfigurationError(
            "lock_metadata must be a callable of the task's arguments giving a dict, "
            f"not {cls.lock_metadata!r}"
        )


def _named(option: str, validate: Any, value: Any, unless: Any = DEFAULT) -> None:
    """``validate(value)``, its error naming ``option``; a value that is ``unless`` (the
    option's "take the setting" default) is not checked."""
    if value is unless:
        return
    try:
        validate(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{option}: {exc}") from None


def _check_choices(cls: Any) -> None:
    """The options that name a choice (or take a callable), and the True/False ones."""
    if not callable(cls.on_locked) and cls.on_locked not in ON_LOCKED:
        choices = ", ".join(ON_LOCKED)
        raise ConfigurationError(
            f"on_locked must be one of {choices} or a callable, not {cls.on_locked!r}"
        )
    if not callable(cls.on_lock_lost) and cls.on_lock_lost not in ON_LOST:
        raise ConfigurationError(
            f"on_lock_lost must be 'log', 'raise' or a callable, not {cls.on_lock_lost!r}"
        )
    if cls.dedupe is not None and cls.dedupe not in dedupe.MODES:
        modes = ", ".join(dedupe.MODES)
        raise ConfigurationError(f"dedupe must be None, {modes}, not {cls.dedupe!r}")
    if not callable(cls.on_duplicate) and cls.on_duplicate not in dedupe.ON_DUPLICATE:
        raise ConfigurationError(
            f"on_duplicate must be 'return', 'raise' or a callable, not {cls.on_duplicate!r}"
        )
    for option in ("once", "lock_across_retries"):
        if not isinstance(getattr(cls, option), bool):
            raise ConfigurationError(
                f"{option} must be True or False, not {getattr(cls, option)!r}"
            )


def _check_retries(cls: Any) -> None:
    """``lock_retry_max`` and the backoff of a task that retries when the key is busy."""
    retry_max = cls.lock_retry_max
    if retry_max is not None and (
        isinstance(retry_max, bool) or not isinstance(retry_max, int) or retry_max < 0
    ):
        raise ConfigurationError(
            f"lock_retry_max must be None or a whole number >= 0, not {retry_max!r}"
        )
    for option in ("lock_retry_backoff", "lock_retry_backoff_max"):
        value = getattr(cls, option)
        # NaN or infinity would reach Celery as a countdown it cannot turn into an eta.
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value <= 0
        ):
            raise ConfigurationError(f"{option} must be finite seconds > 0, not {value!r}")


def check_base(cls: Any) -> None:
    """Refuse a misspelt option on a user's abstract base (``lock_tll = 5``) as it is
    defined: an attribute in our names that no class above defines, close to one of our
    options. One far from every option (``lock_tenant_field``) is the base's own."""
    known = _options_of(cls.__mro__[1:])
    for attribute in _new_in_our_names(cls):
        close = difflib.get_close_matches(attribute.lower(), known, n=1, cutoff=0.8)
        if close:
            raise ConfigurationError(
                f"class {cls.__name__}: unknown option {attribute} (did you mean {close[0]}?)"
            )


def _refuse_unknown(cls: Any) -> None:
    """Refuse an attribute of ``cls`` itself named like one of our options that no base
    class defines (an override of a base's attribute, the user's own included, is left)."""
    known = _options_of(cls.__mro__[1:])
    for attribute in _new_in_our_names(cls):
        close = difflib.get_close_matches(attribute.lower(), known, n=1, cutoff=0.7)
        hint = f"did you mean {close[0]}?" if close else f"the options are {', '.join(known)}"
        raise ConfigurationError(f"unknown option {attribute} ({hint})")


def _options_of(bases: tuple[type, ...]) -> list[str]:
    """The options ``bases`` define, in our names."""
    return sorted(
        {
            name
            for base in bases
            for name, value in vars(base).items()
            if name.startswith(OURS) and not isinstance(value, _NOT_OPTIONS)
        }
    )


def _new_in_our_names(cls: Any) -> list[str]:
    """The attributes ``cls`` itself defines in our names that no base class defines."""
    bases = cls.__mro__[1:]
    return [
        attribute
        for attribute in vars(cls)
        if attribute.startswith(OURS) and not any(attribute in vars(base) for base in bases)
    ]
