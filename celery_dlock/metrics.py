"""Prometheus metrics, with ``prometheus_client`` (the ``[metrics]`` extra).

Off until :func:`enable` (or the Celery setting ``dlock_metrics = True``): then every hook
below is a counter or histogram update; off, each is one function call that returns at
once, and ``prometheus_client`` is never imported. In a prefork worker, set
``PROMETHEUS_MULTIPROC_DIR`` before the worker starts (prometheus_client's multiprocess
mode): each process writes its own file, a scrape sums them, and a SIGKILLed child's counts
stay in its file.

Metrics (base units, Prometheus naming):

- ``dlock_releases_total{task, outcome}``: leases released, by task and outcome;
- ``dlock_held_seconds{task, outcome}``: how long they were held (histogram);
- ``dlock_wait_seconds{task}``: how long an acquisition waited for its key (histogram);
- ``dlock_busy_total{task, policy}``: keys found busy, by the task's ``on_locked`` policy;
- ``dlock_leases_lost_total{task}``: leases lost while held, noticed then or at their
  release (once either way);
- ``dlock_store_seconds{backend, operation}``: store call latency (histogram);
- ``dlock_store_errors_total{backend, operation}``: store calls that failed;
- ``dlock_reaped_total{reason}``: dead leases cleared (``disconnected``, ``expired``), by the
  janitor or by an acquire that took one over (a redelivered task takes its killed
  predecessor's key before any janitor runs).

An update that fails (multiprocess mode's directory removed or not writable) never fails
the lock call it counts: a lease granted and not recorded as held would stay on its key. It
is logged, the first time with its traceback, and that count is missing.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
import time
from typing import Any

from celery_dlock.errors import ConfigurationError
from celery_dlock.events import fields
from celery_dlock.records import Lease, Record

__all__ = [
    "busy",
    "collector",
    "disable",
    "enable",
    "enabled",
    "lost",
    "reaped",
    "released",
    "store_call",
    "store_error",
    "waited",
]

#: Histogram buckets, in seconds: store calls and waits are ms, holds up to hours.
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_SLOW = (0.01, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0)

_on = False
_mutex = threading.Lock()
_metrics: dict[str, Any] = {}
#: The registry the metrics were made in (prometheus_client's global one for None).
_registry: Any = None
#: Labelled children by (metric, labels): ``labels()`` costs more than an update.
_children: dict[tuple[str, tuple[str, ...]], Any] = {}
_failures = 0

logger = logging.getLogger("celery_dlock.metrics")


def enable(registry: Any = None) -> None:
    """Turn the metrics on in this process (idempotent), in ``registry`` (default:
    prometheus_client's global one, or the registry they were made in already).

    Raises:
        ImportError: prometheus_client is not installed (``pip install
            'celery-dlock[metrics]'``).
        ConfigurationError: they were made in another registry already: a process counts
            in one registry.
    """
    global _on, _registry
    with _mutex:
        if _metrics:  # made before (on, or disabled since)
            if registry is not None and registry is not _registry:
                raise ConfigurationError(
                    f"celery-dlock's metrics are in the registry {_registry!r} already, not "
                    f"in {registry!r}: a process counts in one registry (call enable() with "
                    "that one, or with none)"
                )
            _on = True
            return
        try:
            from prometheus_client import REGISTRY, Counter, Histogram  # the [metrics] extra
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                "celery-dlock's metrics need prometheus_client, which is not installed: "
                "pip install 'celery-dlock[metrics]'",
                name=exc.name,
            ) from exc

        where = {} if registry is None else {"registry": registry}
        _registry = REGISTRY if registry is None else registry
        _metrics.update(
            releases=Counter(
                "dlock_releases", "Leases released", ["task", "outcome"], **where
            ),
            held=Histogram(
                "dlock_held_seconds", "Time a lease was held", ["task", "outcome"],
                buckets=_SLOW, **where,
            ),
            wait=Histogram(
                "dlock_wait_seconds", "Time an acquisition waited for its key", ["task"],
                buckets=_FAST + _SLOW[4:], **where,
            ),
            busy=Counter("dlock_busy", "Keys found busy", ["task", "policy"], **where),
            lost=Counter("dlock_leases_lost", "Leases lost while held", ["task"], **where),
            store=Histogram(
                "dlock_store_seconds", "Store call latency", ["backend", "operation"],
                buckets=_FAST, **where,
            ),
            errors=Counter(
                "dlock_store_errors", "Store calls that failed", ["backend", "operation"],
                **where,
            ),
            reaped=Counter(
                "dlock_reaped", "Dead leases cleared (janitor or take-over)", ["reason"], **where
            ),
        )  # fmt: skip
        _on = True


def disable() -> None:
    """Stop updating the metrics in this process (they keep their values)."""
    global _on
    _on = False


def enabled() -> bool:
    """Whether the metrics are on in this process."""
    return _on


def _child(name: str, *labels: str) -> Any:
    key = (name, labels)
    child = _children.get(key)
    if child is None:
        child = _children[key] = _metrics[name].labels(*labels)
    return child


def _update(name: str, labels: tuple[str, ...], value: float | None = None) -> None:
    """Count one in ``name``'s child of ``labels``, or observe ``value``; a failure is
    logged, never raised (see the module's docstring)."""
    global _failures
    try:
        child = _child(name, *labels)
        if value is None:
            child.inc()
        else:
            child.observe(value)
    except Exception as exc:  # a metrics file that cannot be written, say
        _failures += 1
        extra = fields("metrics_failed")
        if _failures == 1:
            logger.exception("a metrics update failed (%s): its count is lost", name, extra=extra)
        else:
            why = f"{type(exc).__name__}: {exc}"
            logger.error("a metrics update failed (%s): %s", name, why, extra=extra)


def released(record: Record) -> None:
    """A lease was released: counted by task and outcome, with how long it was held."""
    if not _on:
        return
    labels = (record.lease.holder.task_name or "", record.outcome.value)
    _update("releases", labels)
    _update("held", labels, max(record.released_at - record.lease.acquired_at, 0.0))


def waited(task: str | None, seconds: float) -> None:
    """An acquisition got its key after ``seconds`` of waiting (0 when it was free)."""
    if _on:
        _update("wait", (task or "",), seconds)


def busy(task: str | None, policy: str) -> None:
    """A task found its key busy, and applies ``policy``."""
    if _on:
        _update("busy", (task or "", policy))


def lost(lease: Lease) -> None:
    """A lease was lost while held."""
    if _on:
        _update("lost", (lease.holder.task_name or "",))


def store_call(backend: str, operation: str, started: float) -> None:
    """A store call that began at ``started`` (``time.perf_counter()``) ended."""
    if _on:
        _update("store", (backend, operation), time.perf_counter() - started)


def store_error(backend: str, operation: str) -> None:
    """A store call failed."""
    if _on:
        _update("errors", (backend, operation))


def reaped(reason: str) -> None:
    """A dead lease was cleared (``disconnected`` or ``expired``): by the janitor, or by
    the acquire that took its key over."""
    if _on:
        _update("reaped", (reason,))


def collector(registry: Any = None, path: str | None = None) -> Any:
    """prometheus_client's ``MultiProcessCollector`` for ``path`` (default:
    ``PROMETHEUS_MULTIPROC_DIR``), registered in ``registry`` when given, that reads past
    the empty file of a process being born.

    A process creates its file before it sizes it; a scrape in between, or forever after
    if the process was killed in between (a prefork child SIGKILLed as it starts), fails
    the whole scrape with ``struct.error`` in the stock collector (prometheus_client issue
    1199, open in 0.26). An empty file holds no sample yet, so it is left out.

    Raises:
        ValueError: ``path`` is not given and ``PROMETHEUS_MULTIPROC_DIR`` is not a
            directory (prometheus_client's own check).
    """
    from prometheus_client.multiprocess import MultiProcessCollector

    class _Collector(MultiProcessCollector):
        def collect(self) -> Any:
            return self.merge(_written(self._path), accumulate=True)  # type: ignore[no-untyped-call]

    return _Collector(registry, path)  # type: ignore[no-untyped-call]


def _written(path: str) -> list[str]:
    """The metrics files under ``path`` that hold a header (a file gone since the listing,
    a process marked dead, is left out too)."""
    files = []
    for name in glob.glob(os.path.join(path, "*.db")):
        try:
            if os.path.getsize(name) > 0:
                files.append(name)
        except FileNotFoundError:
            continue
    return files
