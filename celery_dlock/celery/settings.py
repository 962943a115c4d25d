"""The ``app.conf.dlock_*`` settings: read, validated and cached; pure reads (the warning
about the default store is its own call, :func:`warn_if_default_store`).

Settings (Celery style, all optional)::

    dlock_backend            URL of the lock store           default: a local file store
    dlock_namespace          key prefix                      "job"   (job:order:42)
    dlock_ttl                seconds a lease lives unrenewed None    (liveness only)
    dlock_janitor_interval   seconds between janitor runs    30.0
    dlock_history_retention  seconds of history kept         30 days (None: forever)
    dlock_on_backend_error   "retry" (fail closed) or "run"  "retry"
    dlock_dedupe_ttl         seconds a dedupe mark lives     3600.0
    dlock_janitor_marks      marks a janitor run looks at    100     (0: none)
    dlock_metrics            Prometheus metrics (the [metrics] extra)   False

Settings are read when used, not when installed, so the order of ``install(app)`` and
``app.config_from_object(...)`` does not matter. Any other key starting ``dlock_`` in the
conf (``dlock_ttll``; ``CELERY_DLOCK_TTLL`` under a ``namespace="CELERY"``) is refused as a
misspelt setting. Without a namespace, a setting may also be spelt in upper case
(``DLOCK_BACKEND``), as Celery reads its own old names (``BROKER_URL``); spelt both ways with
two values, it is refused.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from celery_dlock import metrics
from celery_dlock.backends import mask_url
from celery_dlock.backends.base import LockBackend, validate_ttl
from celery_dlock.errors import ConfigurationError, LockKeyError
from celery_dlock.events import fields
from celery_dlock.keys import validate_key
from celery_dlock.process import shared_backend

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "SETTINGS",
    "Settings",
    "backend_for",
    "default_backend_url",
    "enable_metrics",
    "forget_settings",
    "settings",
    "warn_if_default_store",
]

logger = logging.getLogger("celery_dlock")

_DAY = 86400.0
_warned_default = threading.Event()
#: Every ``dlock_*`` setting: a key of the app's conf so named that is not one is refused.
SETTINGS = (
    "dlock_backend",
    "dlock_namespace",
    "dlock_ttl",
    "dlock_janitor_interval",
    "dlock_history_retention",
    "dlock_on_backend_error",
    "dlock_dedupe_ttl",
    "dlock_janitor_marks",
    "dlock_metrics",
)


@dataclass(frozen=True, slots=True)
class Settings:
    """The ``dlock_*`` settings of one app, validated."""

    backend: str
    namespace: str
    ttl: float | None
    janitor_interval: float
    history_retention: float | None
    on_backend_error: Literal["retry", "run"]
    #: ``backend`` is the local file store used because ``dlock_backend`` is not set.
    default_backend: bool = False
    #: Seconds a ``dedupe`` mark lives past its message's countdown (``dlock_dedupe_ttl``).
    dedupe_ttl: float = 3600.0
    #: Prometheus metrics on (``dlock_metrics``; see :mod:`celery_dlock.metrics`).
    metrics: bool = False
    #: Dedupe marks a janitor run looks at for a message that has run (``dlock_janitor_marks``).
    janitor_marks: int = 100


def default_backend_url() -> str:
    """The local file store used when ``dlock_backend`` is not set."""
    return f"file://{tempfile.gettempdir()}/celery-dlock-{os.getuid()}"


#: Settings are read again at most this often (reading Celery's conf costs ~6 µs a key,
#: which a task would otherwise pay on every run).
SETTINGS_TTL = 1.0
_cache: weakref.WeakKeyDictionary[Celery, tuple[float, Settings]] = weakref.WeakKeyDictionary()


def settings(app: Celery) -> Settings:
    """The app's ``dlock_*`` settings, with defaults; a change to ``app.conf`` is seen
    within :data:`SETTINGS_TTL` seconds, or at once after :func:`forget_settings`.

    Raises:
        ConfigurationError: a setting has a bad value; the message names it.
    """
    cached = _cache.get(app)
    now = time.monotonic()
    if cached is not None and now - cached[0] < SETTINGS_TTL:
        return cached[1]
    current = _read_settings(app)
    _cache[app] = (now, current)
    return current


def forget_settings(app: Celery) -> None:
    """Read ``app``'s settings afresh on next use (after changing ``app.conf`` at run time)."""
    _cache.pop(app, None)


def _read_settings(app: Celery) -> Settings:
    _refuse_unknown(app.conf)
    conf = _spelt_either_way(app.conf)
    url = conf.get("dlock_backend")
    default = url is None
    if default:
        url = default_backend_url()
    elif not isinstance(url, str):
        raise ConfigurationError(f"dlock_backend must be a URL string, not {url!r}")
    namespace = conf.get("dlock_namespace", "job")
    if not isinstance(namespace, str):
        raise ConfigurationError(f"dlock_namespace must be a string, not {namespace!r}")
    try:  # a namespace no key can hold (a control character) fails the worker's start
        validate_key(f"{namespace}:x")
    except LockKeyError as exc:
        raise ConfigurationError(f"dlock_namespace {namespace!r}: {exc}") from None
    try:
        ttl = validate_ttl(conf.get("dlock_ttl"))
    except ConfigurationError as exc:
        raise ConfigurationError(f"dlock_ttl: {exc}") from None
    interval = _seconds(conf.get("dlock_janitor_interval", 30.0), "dlock_janitor_interval")
    retention_value = conf.get("dlock_history_retention", 30 * _DAY)
    retention = (
        None if retention_value is None else _seconds(retention_value, "dlock_history_retention")
    )
    on_error = conf.get("dlock_on_backend_error", "retry")
    if on_error not in ("retry", "run"):
        raise ConfigurationError(
            f"dlock_on_backend_error must be 'retry' (fail closed) or 'run', not {on_error!r}"
        )
    dedupe_ttl = _seconds(conf.get("dlock_dedupe_ttl", 3600.0), "dlock_dedupe_ttl")
    metrics = conf.get("dlock_metrics", False)
    if not isinstance(metrics, bool):
        raise ConfigurationError(f"dlock_metrics must be True or False, not {metrics!r}")
    marks = conf.get("dlock_janitor_marks", 100)
    if isinstance(marks, bool) or not isinstance(marks, int) or marks < 0:
        raise ConfigurationError(
            f"dlock_janitor_marks must be a whole number of marks >= 0, not {marks!r}"
        )
    return Settings(
        url, namespace, ttl, interval, retention, on_error, default, dedupe_ttl, metrics, marks
    )


def _refuse_unknown(conf: Any) -> None:
    """Refuse a ``dlock_*`` key of ``conf`` that is not a setting (``dlock_ttll = 5`` would
    otherwise leave leases without a ttl), naming the closest setting.

    Keys are taken as Celery reads its own: lower-case, or after the prefix of
    ``config_from_object(..., namespace=...)`` in the prefix's case (``CELERY_DLOCK_TTL``).
    An upper-case ``DLOCK_*`` without a namespace may be anyone's (a Django setting)."""
    keys = list(conf.keys())
    prefix = getattr(conf, "prefix", None) or ""  # set as the keys are first read
    for key in keys:
        if not isinstance(key, str):
            continue
        spelt, name = "", key
        if prefix and key.startswith(prefix):
            spelt, name = prefix, key[len(prefix) :]
            name = name.lower() if prefix.isupper() and name.isupper() else name
        if not name.startswith("dlock_") or name in SETTINGS:
            continue
        close = difflib.get_close_matches(name.lower(), SETTINGS, n=1, cutoff=0.7)
        known = [spelt + (n.upper() if spelt.isupper() else n) for n in close or SETTINGS]
        hint = f"did you mean {known[0]}?" if close else f"the settings are {', '.join(known)}"
        raise ConfigurationError(f"unknown setting {key} ({hint})")


def _spelt_either_way(conf: Any) -> Any:
    """``conf``, or with no namespace and an upper-case ``DLOCK_*`` setting given, a dict of
    the settings read either way (an old-style config module: ``DLOCK_BACKEND`` beside
    ``BROKER_URL``, which would otherwise leave the tasks on the local default store)."""
    if getattr(conf, "prefix", None) or not any(n.upper() in conf for n in SETTINGS):
        return conf
    given: dict[str, Any] = {}
    for name in SETTINGS:
        spellings = [n for n in (name, name.upper()) if n in conf]
        values = [conf[n] for n in spellings]
        if len(values) == 2 and values[0] != values[1]:
            raise ConfigurationError(
                f"{name} is set to {values[0]!r} and {name.upper()} to {values[1]!r}: keep one"
            )
        if values:
            given[name] = values[0]
    return given


#: The longest duration a setting takes (100 years): beat adds the janitor's interval to
#: each run's time, and ``1e12`` s passed year 9999, where Python's datetime ends; a
#: retention that long reached back before 1970.
LONGEST = 100 * 365.25 * 86400


def _seconds(value: Any, name: str) -> float:
    # NaN and infinity are refused too: a NaN retention made every janitor run fail on Redis
    # (and prune nothing elsewhere), an infinite interval stopped beat at its start.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= LONGEST:
        raise ConfigurationError(
            f"{name} must be a positive number of seconds, at most {LONGEST:.0f} (100 "
            f"years), not {value!r}"
        )
    return float(value)


def warn_if_default_store(current: Settings) -> None:
    """Warn once per process when ``current`` uses the default local file store."""
    if current.default_backend and not _warned_default.is_set():
        _warned_default.set()
        logger.warning(
            "dlock_backend is not set: locks live in the local file store %s, which only "
            "processes on this host share; set app.conf.dlock_backend for more",
            current.backend,
            extra=fields("default_store", backend=current.backend),
        )


def enable_metrics() -> None:
    """``dlock_metrics = True``: the metrics on in this process.

    Raises:
        ConfigurationError: prometheus_client is not installed.
    """
    try:
        metrics.enable()
    except ImportError as exc:
        raise ConfigurationError(
            f"dlock_metrics needs prometheus_client: pip install 'celery-dlock[metrics]' ({exc})"
        ) from exc


def backend_for(app: Celery) -> LockBackend:
    """The lock store of ``app`` in this process (one per URL per process).

    Raises:
        ConfigurationError: a setting is bad, or ``dlock_backend`` names no store that can
            be built (an unknown scheme: ``UnknownBackendError``; a driver not installed:
            ``MissingDependencyError``), noted with the setting and its URL, password masked.
    """
    url = settings(app).backend
    try:
        return shared_backend(url)
    except ConfigurationError as exc:
        # Its class is kept (``except UnknownBackendError`` still works); a traceback, such
        # as a worker's that this stops at its start, prints the note under the message.
        if sys.version_info >= (3, 11):
            exc.add_note(f"in the setting dlock_backend = {mask_url(url)}")
        raise
