"""Bad option values on a ``LockedTask`` are refused when the task is created, by a
``ConfigurationError`` that names the task and the option (not a bare ``ttl`` or ``limit``,
which says nothing of ``lock_ttl`` vs ``dedupe_ttl``). A NaN or infinite busy-key backoff is
refused too: as a re-queue's countdown Celery cannot turn it into an eta, so the first busy
key would fail the task with a ValueError/OverflowError instead of re-queueing it."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import Celery

from celery_dlock import ConfigurationError, LockedTask

BAD = [
    ("lock_ttl", 0),
    ("lock_ttl", float("nan")),
    ("dedupe_ttl", -1),
    ("lock_limit", 0),
    ("lock_limit", 2.5),
    ("lock_wait", -1),
    ("lock_retry_backoff", float("nan")),
    ("lock_retry_backoff", float("inf")),
    ("lock_retry_backoff_max", float("nan")),
    ("lock_retry_backoff_max", float("inf")),
]


@pytest.mark.parametrize(("option", "value"), BAD, ids=[f"{o}={v}" for o, v in BAD])
def test_a_bad_option_value_is_refused_naming_task_and_option(option: str, value: Any) -> None:
    app = Celery("probe_options", set_as_current=False)
    app.conf.dlock_backend = "memory://probe-options"
    name = f"probe.options.{uuid.uuid4().hex[:8]}"
    options: dict[str, Any] = {option: value}
    if option == "dedupe_ttl":
        options["dedupe"] = "until_started"

    @app.task(shared=False, base=LockedTask, name=name, lock_key="tenant:{tenant}", **options)
    def export(tenant: str) -> None:
        return None

    with pytest.raises(ConfigurationError) as info:
        _ = export.name  # the task class is made here, and its options checked
    assert str(info.value).startswith(f"task {name}: {option}")
